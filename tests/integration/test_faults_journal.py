"""The owed-write journal on a full disk (issue 37, D2): a journal write that fails (ENOSPC on a real tmpfs) never
stops the drain of what is owed to S3, never stops the daemon from starting, and never stops it closing cleanly.

Real parts: ``kvbm serve`` in a subprocess, its G3 and journal on a 16 MiB tmpfs that the test fills, and a
SeaweedFS of the test's own that it stops and brings back on the same port."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc, wait_until
from tmpfs_mount import mounted_tmpfs

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.config import S3Config
from kvbm.manager.owed_journal import JOURNAL_NAME
from kvbm.s3server import EmbeddedS3
from kvbm.tiers.s3 import make_s3_tier

pytestmark = pytest.mark.s3

LAYOUT = KVLayout(model="journal", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
NB = LAYOUT.block_nbytes
FAST = dict(max_retries=0, connect_timeout_s=0.5, read_timeout_s=5.0, breaker_failures=2, breaker_reset_s=1.0)
N = 100  # more than one drain batch (64): the journal write after the first batch is the one that fails


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path, "16m") as mnt:
        yield mnt


@pytest.fixture
def srv(weed_binary: str, tmp_path: Path) -> Iterator[EmbeddedS3]:
    s = EmbeddedS3(tmp_path / "sw", weed=weed_binary, bucket="kvbm-journal", stop_timeout_s=1.0, reuse=False)
    s.start()
    try:
        yield s
    finally:
        s.stop(force=True)


def daemon_cfg(tmp: Path, disk: Path, s: EmbeddedS3 | None, prefix: str = "") -> dict:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(disk), "capacity": "10MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False} if s is None else {
            "endpoint": s.endpoint, "bucket": s.bucket, "prefix": prefix, "access_key": s.access_key,
            "secret_key": s.secret_key, **FAST},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", "metrics_port": 0},
    }


def payload(k: BlockKey) -> np.ndarray:
    return np.frombuffer((k.hash * (NB // 16 + 1))[:NB], dtype=np.uint8).copy()


def missing_from_bucket(s: EmbeddedS3, prefix: str, ks: list[BlockKey]) -> int:
    """How many of ``ks`` a fresh S3 client cannot read back as stored (no shared index or cache)."""

    async def go() -> int:
        t = make_s3_tier(S3Config(bucket=s.bucket, prefix=prefix, **FAST), s.endpoint, (s.access_key, s.secret_key))
        await t.start()
        try:
            bad = 0
            for k in ks:
                out = bytearray(NB)
                n = await t.get_into(k, memoryview(out))
                bad += n is None or bytes(out[:n]) != payload(k).tobytes()
            return bad
        finally:
            await t.close()

    return asyncio.run(go())


def fill(fs: Path) -> Path:
    """Fill ``fs`` to the last page: every later write needing a new page fails ENOSPC."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def store_owed(d: ServeProc, s: EmbeddedS3, disk: Path) -> list[BlockKey]:
    """With S3 down, ``N`` durable stores (durable on G3), each owed to G4 and journaled."""
    s.stop(force=True)
    ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(N)]
    with d.client() as c:
        c.register(LAYOUT, worker_id="w")
        for i in range(0, N, 10):
            ack = c.store(ks[i:i + 10], [payload(k) for k in ks[i:i + 10]], durable=True)
            assert ack.durable == 10
        assert wait_until(lambda: c.stats()["manager"]["owed"].get("G4", 0) == N), c.stats()["manager"]
    journal = disk / JOURNAL_NAME
    assert wait_until(lambda: journal.exists() and journal.read_text().count("+ G4 ") >= N)
    return ks


def test_a_journal_write_failing_enospc_does_not_stop_the_drain(small_fs: Path, srv: EmbeddedS3,
                                                                tmp_path: Path) -> None:
    """S3 down, 100 blocks owed, then G3's filesystem fills; S3 comes back: the first batch is paid, its journal
    lines cannot be written, and the rest are paid all the same, the failure logged."""
    disk = small_fs / "disk"
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, disk, srv, "drain")).start()
    try:
        ks = store_owed(d, srv, disk)
        fill(small_fs)
        port = srv.port
        srv.start()
        assert srv.port == port
        assert wait_until(lambda: missing_from_bucket(srv, "drain", ks) == 0, timeout=60, step=1.0), \
            f"{missing_from_bucket(srv, 'drain', ks)} of {N} owed blocks never reached S3"
        assert "journal" in d.log_path.read_text() and "No space left" in d.log_path.read_text()
    finally:
        d.stop()


def test_a_full_disk_neither_stops_the_daemon_starting_nor_closing(small_fs: Path, srv: EmbeddedS3,
                                                                   tmp_path: Path) -> None:
    """Blocks owed when the daemon stops; G3's filesystem is full when it starts again (the journal cannot be
    rewritten): it starts, pays what the journal owed once S3 is back, and stops cleanly (exit 0, no traceback)
    though the paid lines cannot be journaled."""
    disk = small_fs / "disk"
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, disk, srv, "restart")).start()
    try:
        ks = store_owed(d, srv, disk)
        d.stop()
        assert d.proc is not None and d.proc.returncode == 0
        fill(small_fs)
        d.start()
        port = srv.port
        srv.start()
        assert srv.port == port
        assert wait_until(lambda: missing_from_bucket(srv, "restart", ks) == 0, timeout=60, step=1.0), \
            f"{missing_from_bucket(srv, 'restart', ks)} of {N} owed blocks never reached S3"
    finally:
        d.stop()
    assert d.proc.returncode == 0 and "Traceback" not in d.log_path.read_text(), d.log_path.read_text()[-3000:]


def test_temporary_journal_files_of_a_killed_compaction_are_removed_at_start(tmp_path: Path) -> None:
    """A run killed while compacting the journal leaves its unique temporary file; each kill one more. The next
    start removes them (and leaves the journal and the block files alone)."""
    disk = tmp_path / "disk"
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, disk, None)).start()
    d.stop()
    journal = disk / JOURNAL_NAME
    journal.write_text("")
    left = [disk / f"{JOURNAL_NAME}.{pid}.{uuid.uuid4().hex[:8]}.tmp" for pid in (4242, 4243, 4244)]
    for f in left:
        f.write_text("+ G4 00 x-0000000000000000\n" * 1000)  # as a killed compaction leaves it
    other = disk / "keep.tmp"
    other.write_text("not the journal's")
    d.start()
    try:
        assert not [f for f in left if f.exists()], sorted(p.name for p in disk.iterdir())
        assert journal.exists() and other.exists()
    finally:
        d.stop()


def journal_owed(journal: Path) -> set[str]:
    """The block hashes a journal holds owed to G4 and not paid (as a restart replays it)."""
    owed: set[str] = set()
    for line in journal.read_text().splitlines():
        op, tier, h, _ns = line.split(" ", 3)
        if tier == "G4":
            (owed.add if op == "+" else owed.discard)(h)
    return owed


def test_a_journal_deleted_under_the_daemon_is_written_again_whole(srv: EmbeddedS3, tmp_path: Path) -> None:
    """S3 down, 10 blocks owed and journaled; the journal is deleted; 5 more are owed. The journal the daemon
    writes then holds all 15 (before: the 5 new ones only, and a restart forgot the first 10)."""
    disk = tmp_path / "disk"
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, disk, srv, "deleted")).start()
    journal = disk / JOURNAL_NAME
    try:
        srv.stop(force=True)
        ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(15)]
        with d.client() as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks[:10], [payload(k) for k in ks[:10]], durable=True).durable == 10
            assert wait_until(lambda: journal.exists() and len(journal_owed(journal)) == 10)
            journal.unlink()
            assert c.store(ks[10:], [payload(k) for k in ks[10:]], durable=True).durable == 5
            assert wait_until(lambda: journal.exists() and len(journal_owed(journal)) >= 5)
            assert journal_owed(journal) == {k.hash.hex() for k in ks}
    finally:
        d.stop()


def drop_from_bucket(s: EmbeddedS3, prefix: str, ks: list[BlockKey]) -> None:
    """Delete ``ks`` from the bucket behind the daemon's back (a lifecycle rule, another node's purge)."""

    async def go() -> None:
        t = make_s3_tier(S3Config(bucket=s.bucket, prefix=prefix, **FAST), s.endpoint, (s.access_key, s.secret_key))
        await t.start()
        try:
            await t.delete_blocks(ks)
        finally:
            await t.close()

    asyncio.run(go())


def test_a_clean_restart_does_not_upload_again_what_the_bucket_dropped(srv: EmbeddedS3, tmp_path: Path) -> None:
    """Five blocks reach the bucket, which then drops them (expiry); after a clean stop the restart owes nothing
    (before: it re-uploaded all five, at every restart). After a SIGKILL, when a cascade may have been cut short,
    the start reconciles the disk against the bucket as before."""
    disk = tmp_path / "disk"
    cfg = daemon_cfg(tmp_path, disk, srv, "dropped")
    cfg["daemon"]["index_bucket"] = "start"
    d = ServeProc(tmp_path, cfg).start()
    ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(5)]
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks], durable=True).durable == 5
        assert missing_from_bucket(srv, "dropped", ks) == 0
        drop_from_bucket(srv, "dropped", ks)
        d.stop()
        d.start()  # index_bucket: start: the bucket is listed (and reconciled) before it serves
        with d.client() as c:
            m = c.stats()["manager"]
            assert m["owed_reconciled"] == 0 and not m["owed"], m
        assert missing_from_bucket(srv, "dropped", ks) == 5
        d.kill9()
        d.start()
        with d.client() as c:
            assert c.stats()["manager"]["owed_reconciled"] == 5
    finally:
        d.stop()


def test_a_lazy_start_reconciles_namespaces_nobody_registers_again(srv: EmbeddedS3, tmp_path: Path) -> None:
    """S3 down, 10 blocks durable on G3 and owed; the daemon is SIGKILLed and its journal lost. Restarted with
    ``index_bucket: lazy`` and S3 back, the start-up reconcile lists the namespaces the disk holds, so the 10 reach
    the bucket though no worker of that namespace registers again (before: only registered namespaces were)."""
    disk = tmp_path / "disk"
    cfg = daemon_cfg(tmp_path, disk, srv, "lazy")
    cfg["daemon"]["index_bucket"] = "lazy"
    d = ServeProc(tmp_path, cfg).start()
    ks = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(10)]
    try:
        srv.stop(force=True)
        with d.client() as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks], durable=True).durable == 10
        d.kill9()
        (disk / JOURNAL_NAME).unlink(missing_ok=True)
        srv.start()
        d.start()
        assert wait_until(lambda: missing_from_bucket(srv, "lazy", ks) == 0, timeout=30), "never reconciled"
    finally:
        d.stop()
