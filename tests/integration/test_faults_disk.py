"""A disk tier that cannot remove a block file (issue 37, D4): purge never reports a block gone whose file stays,
and the block stays indexed and served. Real parts: ``kvbm serve`` in a subprocess, its G3 on a tmpfs the test
makes read-only (EROFS on every unlink)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc
from tmpfs_mount import mounted_tmpfs

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError, WorkerClient

LAYOUT = KVLayout(model="disk-faults", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_block=64)
NB = LAYOUT.block_nbytes


def mount(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["mount", *args], capture_output=True)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path, "16m") as mnt:
        yield mnt


def payload(k: BlockKey) -> np.ndarray:
    return np.frombuffer((k.hash * (NB // 16 + 1))[:NB], dtype=np.uint8).copy()


def g3_blocks(c: WorkerClient) -> int:
    return next(t["blocks"] for t in c.stats()["tiers"] if t["tier"] == "G3")


def test_an_unlink_refused_read_only_is_reported_and_the_block_stays(fs: Path, tmp_path: Path) -> None:
    cfg = {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(fs / "disk"), "capacity": "8MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0},
    }
    d = ServeProc(tmp_path, cfg).start()
    try:
        ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(4)]
        with d.client(admin=True) as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks], durable=True).durable == 4
            assert g3_blocks(c) == 4
            # The namespace's directory read-only (a bind mount of itself: the daemon's lock file stays writable).
            nsdir = str(fs / "disk" / LAYOUT.namespace)
            assert mount("--bind", nsdir, nsdir).returncode == 0
            r = mount("-o", "remount,ro,bind", nsdir)
            assert r.returncode == 0, r.stderr
            with pytest.raises(DaemonError) as e:
                c.evict(ks, tiers=["G3"])
            assert e.value.code == p.E_UNAVAILABLE and "Read-only file system" in str(e.value), str(e.value)
            assert g3_blocks(c) == 4 and len(list((fs / "disk").rglob("*.kvb"))) == 4  # indexed: the files are there
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == 4 and all(np.array_equal(o, payload(k)) for o, k in zip(outs, ks, strict=True))
            assert subprocess.run(["umount", nsdir], capture_output=True).returncode == 0
            assert c.evict(ks, tiers=["G3"]).removed == 4  # writable again: removed, and reported so
            assert g3_blocks(c) == 0 and not any((fs / "disk").rglob("*.kvb"))
    finally:
        d.stop()
