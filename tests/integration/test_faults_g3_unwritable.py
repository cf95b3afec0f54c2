"""A G3 directory the daemon cannot write (issue 37; the chaos harness, seeds 104, 14020 and 14065) no longer stops
the start, and no longer loses what it holds: a read-only or immutable one is opened read-only (served, its owed
journal replayed, its blocks paid to the bucket once S3 is back, nothing written), said loudly in the log and shown by
``kvbm status``; one that cannot even be created is turned off. Real parts: ``kvbm serve`` in a subprocess, G3 on a
tmpfs remounted read-only, SeaweedFS stopped and brought back on its port, the ``kvbm`` CLI in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc, wait_until
from tmpfs_mount import mounted_tmpfs

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.config import S3Config
from kvbm.s3server import EmbeddedS3
from kvbm.tiers.s3 import make_s3_tier

LAYOUT = KVLayout(model="g3-off", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
NB = LAYOUT.block_nbytes
# Fail fast against a dead endpoint (as tests/integration/test_durability.py).
FAST = dict(max_retries=0, connect_timeout_s=0.5, read_timeout_s=5.0, breaker_failures=2, breaker_reset_s=1.0)


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


@pytest.mark.s3
def test_blocks_owed_from_a_g3_that_became_read_only_are_served_and_reach_the_bucket(weed_binary: str,
                                                                                     tmp_path: Path) -> None:
    """Chaos seeds 14020/14065: 8 blocks acked durable while S3 was down (on G3, owed to G4); the daemon is killed,
    G3's filesystem becomes read-only, the daemon starts again with S3 still down, then S3 comes back. The 8 are
    served from G3 meanwhile and all 12 blocks reach the bucket with their bytes; G3's files are untouched."""
    srv = EmbeddedS3(tmp_path / "sw", weed=weed_binary, bucket="kvbm-g3ro", stop_timeout_s=1.0, reuse=False)
    srv.start()
    with mounted_tmpfs(tmp_path, "16m") as mnt:
        cfg = local_cfg(tmp_path, mnt / "disk")
        cfg["s3"] = {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": "g3ro", "access_key": srv.access_key,
                     "secret_key": srv.secret_key, **FAST}
        d = ServeProc(tmp_path, cfg)
        ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(12)]
        try:
            d.start()
            with d.client() as c:
                c.register(LAYOUT, worker_id="w")
                assert c.store(ks[:4], [payload(k) for k in ks[:4]], durable=True).durable == 4
                srv.stop(force=True)
                ack = c.store(ks[4:], [payload(k) for k in ks[4:]], durable=True)
                assert ack.stored == 8 and ack.durable == 8  # on G3
                assert wait_until(lambda: c.stats()["manager"]["owed"].get("G4") == 8)
            time.sleep(0.3)  # the journal has its lines
            d.kill9()
            assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
            files = sorted((p.name, p.stat().st_mtime_ns) for p in (mnt / "disk").rglob("*") if p.is_file())
            d.start()
            with d.client() as c:
                c.register(LAYOUT, worker_id="w")
                outs = [np.zeros(NB, np.uint8) for _ in ks[4:]]
                assert c.load(ks[4:], outs) == 8, "G3's blocks are not served"
                assert all(np.array_equal(o, payload(k)) for o, k in zip(outs, ks[4:], strict=True))
            srv.start()
            assert wait_until(lambda: in_bucket(srv, ks) == 12, timeout=60) or in_bucket(srv, ks) == 12, \
                f"{in_bucket(srv, ks)} of 12 in the bucket"
            with d.client() as c:
                c.register(LAYOUT, worker_id="w")
                m = c.stats()["manager"]
                assert m["owed_paid"] == 8 and m["owed"] == {}, m
            assert sorted((p.name, p.stat().st_mtime_ns) for p in (mnt / "disk").rglob("*") if p.is_file()) == files
        finally:
            d.stop()
            srv.stop(force=True)


def in_bucket(srv: EmbeddedS3, ks: list[BlockKey]) -> int:
    """How many of ``ks`` a fresh S3 client reads from the bucket with their bytes."""

    async def go() -> int:
        t = make_s3_tier(S3Config(bucket=srv.bucket, prefix="g3ro", **FAST), srv.endpoint,
                         (srv.access_key, srv.secret_key))
        await t.start()
        try:
            n = 0
            for k in ks:
                out = bytearray(NB)
                got = await t.get_into(k, memoryview(out))
                n += got == NB and bytes(out) == payload(k).tobytes()
            return n
        finally:
            await t.close()

    return asyncio.run(go())
