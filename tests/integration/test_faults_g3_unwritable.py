"""A G3 directory the daemon cannot write (issue 37; the chaos harness, seeds 104, 14020 and 14065) no longer stops
the start, and no longer loses what it holds: a read-only or immutable one is opened read-only (served, its owed
journal replayed, its blocks paid to the bucket once S3 is back, nothing written), said loudly in the log and shown by
``kvbm status``; one that cannot even be created is turned off. Real parts: ``kvbm serve`` in a subprocess, G3 on a
tmpfs remounted read-only, the ``kvbm`` CLI in a subprocess. The blocks such a G3 owed the bucket:
``test_durability.py::test_blocks_owed_from_a_g3_that_became_read_only_are_served_and_reach_the_bucket``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc
from tmpfs_mount import mounted_tmpfs

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout

LAYOUT = KVLayout(model="g3-off", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
NB = LAYOUT.block_nbytes


@pytest.fixture
def ro_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs holding an empty ``disk`` directory, remounted read-only."""
    with mounted_tmpfs(tmp_path, "16m") as mnt:
        (mnt / "disk").mkdir()
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        yield mnt


def payload(k: BlockKey) -> np.ndarray:
    return np.frombuffer((k.hash * (NB // 16 + 1))[:NB], dtype=np.uint8).copy()


def status(cfg_path: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
    r = subprocess.run([sys.executable, "-m", "kvbm.cli.main", "--config", str(cfg_path), "status", *args],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def local_cfg(tmp_path: Path, disk_dir: Path) -> dict:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(disk_dir), "capacity": "8MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0},
    }


def stores_and_loads(d: ServeProc) -> None:
    ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(4)]
    with d.client() as c:
        c.register(LAYOUT, worker_id="w")
        assert c.store(ks, [payload(k) for k in ks], durable=False).stored == 4
        outs = [np.zeros(NB, np.uint8) for _ in ks]
        assert c.load(ks, outs) == 4 and all(np.array_equal(o, payload(k)) for o, k in zip(outs, ks, strict=True))


def test_a_g3_directory_it_cannot_write_is_opened_read_only_and_the_daemon_serves(ro_fs: Path,
                                                                                   tmp_path: Path) -> None:
    d = ServeProc(tmp_path, local_cfg(tmp_path, ro_fs / "disk")).start()
    try:
        log = d.log_path.read_text()
        assert '"tier.read_only"' in log and "disk.dir" in log and "Traceback" not in log, log[-2000:]
        stores_and_loads(d)  # G2 takes them; G3 is not written (it could not be)
        g3 = next(t for t in json.loads(status(d.cfg_path, "--json"))["tiers"] if t["tier"] == "G3")
        assert g3["kind"] == "disk" and "disk.dir" in g3["read_only"] and g3["blocks"] == 0, g3
        assert any(line.split()[:3] == ["G3", "disk", "(read-only)"] for line in status(d.cfg_path).splitlines())
    finally:
        d.stop()


def test_a_g3_directory_it_cannot_create_is_turned_off_and_the_daemon_serves(ro_fs: Path, tmp_path: Path) -> None:
    d = ServeProc(tmp_path, local_cfg(tmp_path, ro_fs / "never-made")).start()
    try:
        log = d.log_path.read_text()
        assert '"tier.off"' in log and "disk.dir" in log and "Traceback" not in log, log[-2000:]
        stores_and_loads(d)
        g3 = next(t for t in json.loads(status(d.cfg_path, "--json"))["tiers"] if t["tier"] == "G3")
        assert g3["kind"] == "off" and g3["capacity_bytes"] == 0, g3
        assert any(line.split()[:2] == ["G3", "off"] for line in status(d.cfg_path).splitlines())
    finally:
        d.stop()
