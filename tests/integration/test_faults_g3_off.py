"""Serving without a G3 it cannot write (issue 37; the chaos harness, seed 104): a G3 directory on a read-only
filesystem no longer stops the start. The daemon serves with G3 off, says so loudly in its log, and ``kvbm status``
shows the tier off with the reason naming ``disk.dir``. Real parts: ``kvbm serve`` in a subprocess, G3 on a tmpfs
remounted read-only, the ``kvbm`` CLI in a subprocess."""

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


def test_a_g3_directory_it_cannot_write_is_turned_off_and_the_daemon_serves(ro_fs: Path, tmp_path: Path) -> None:
    cfg = {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(ro_fs / "disk"), "capacity": "8MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0},
    }
    d = ServeProc(tmp_path, cfg).start()
    try:
        log = d.log_path.read_text()
        assert '"tier.off"' in log and "disk.dir" in log and "Traceback" not in log, log[-2000:]
        ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(4)]
        with d.client() as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks], durable=False).stored == 4
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == 4 and all(np.array_equal(o, payload(k)) for o, k in zip(outs, ks, strict=True))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
        r = subprocess.run([sys.executable, "-m", "kvbm.cli.main", "--config", str(d.cfg_path), "status", "--json"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        g3 = next(t for t in json.loads(r.stdout)["tiers"] if t["tier"] == "G3")
        assert g3["kind"] == "off" and g3["capacity_bytes"] == 0, g3
        r = subprocess.run([sys.executable, "-m", "kvbm.cli.main", "--config", str(d.cfg_path), "status"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert any(line.split()[:2] == ["G3", "off"] for line in r.stdout.splitlines()), r.stdout
    finally:
        d.stop()
