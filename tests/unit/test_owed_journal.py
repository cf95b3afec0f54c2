"""The owed-write journal on a real disk tier's directory: one flush at a time, rewrites that never share a
temporary file. (That an owed write reaches the journal promptly, and a crash loses nothing, is
tests/integration/test_durability.py against a real daemon and SeaweedFS.)"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import kvbm.manager.owed_journal as owed_mod
from kvbm.blocks import BlockKey
from kvbm.config import TransferConfig
from kvbm.manager import BlockManager
from kvbm.manager.owed_journal import JOURNAL_NAME
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.host import HostTier
from kvbm.transfer import make_file_io

SLOT = 4096


def key(i: int) -> BlockKey:
    return BlockKey("tiny-0123456789abcdef", i.to_bytes(8, "big") * 2)


def manager(tmp: Path) -> BlockManager:
    io = make_file_io(TransferConfig(backend="plain"))
    return BlockManager([HostTier(4 * SLOT, SLOT), DiskTier(str(tmp / "disk"), 64 * (SLOT + 8192), io, fsync=False)])


def test_journal_flushes_run_one_at_a_time_and_lose_no_line(tmp_path, monkeypatch):
    """A flush in its thread while more blocks are owed and a second flush and the shutdown's close start: the
    journal file is written by one flush at a time (an append never lands in a file being replaced) and replays
    to exactly what is owed."""
    inflight = [0]
    most = [0]
    guard = threading.Lock()

    def slow(fn):
        def wrapped(*a, **kw):
            with guard:
                inflight[0] += 1
                most[0] = max(most[0], inflight[0])
            try:
                time.sleep(0.05)  # a slow disk: the window in which a second writer would overlap
                return fn(*a, **kw)
            finally:
                with guard:
                    inflight[0] -= 1
        return wrapped

    monkeypatch.setattr(owed_mod, "_append", slow(owed_mod._append))
    monkeypatch.setattr(owed_mod, "_rewrite", slow(owed_mod._rewrite))
    mgr = manager(tmp_path)

    async def go() -> set[tuple[str, BlockKey]]:
        await mgr.start()
        ow = mgr.owed_writes
        ow.every_s = 3600.0  # nothing is drained meanwhile: only the journal is under test
        ow.journal_delay_s = 3600.0
        for i in range(50):
            ow.owe("G3", key(i))
        first = asyncio.ensure_future(ow.flush())
        await asyncio.sleep(0.01)  # the first flush is in its thread now
        for i in range(50, 100):
            ow.owe("G3", key(i))
        second = asyncio.ensure_future(ow.flush())
        await asyncio.gather(first, second)
        for i in range(100, 150):  # a flush cancelled while its thread writes (a shutdown): the next one waits
            ow.owe("G3", key(i))
        cancelled = asyncio.ensure_future(ow.flush())
        await asyncio.sleep(0.01)
        cancelled.cancel()
        for i in range(150, 200):
            ow.owe("G3", key(i))
        await asyncio.gather(cancelled, ow.flush(), ow.close(), return_exceptions=True)
        assert cancelled.cancelled()
        owed = {(t, k) for t, keys in ow._owed.items() for k in keys}
        for tier in mgr.tiers:
            await tier.close()
        return owed

    owed = asyncio.run(go())
    assert len(owed) == 200
    assert most[0] == 1, f"{most[0]} journal writes overlapped"
    journal = tmp_path / "disk" / JOURNAL_NAME
    assert set(owed_mod._replay(journal)) == owed
    assert not list(journal.parent.glob(f"{JOURNAL_NAME}*.tmp"))


def test_journal_rewrites_never_share_a_temporary_file(tmp_path):
    """Two compacting rewrites of one journal at once (say two flushes of a shutdown): neither fails nor leaves the
    file mixed; it ends as one of the two complete versions, with no temporary file left."""
    path = tmp_path / JOURNAL_NAME
    versions = [[f"+ G4 {i:032x} ns-{v}\n" for i in range(2000)] for v in range(2)]
    errors: list[BaseException] = []

    def writer(lines: list[str]) -> None:
        try:
            for _ in range(30):
                owed_mod._rewrite(path, lines)
        except BaseException as e:  # the failure under test
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(v,)) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_text().splitlines(keepends=True) in versions
    assert not list(tmp_path.glob("*.tmp"))


def test_a_block_owed_while_the_drain_flushes_its_last_lines_is_paid(tmp_path):
    """The drain's last act is a journal flush (its paid lines), which yields. A block owed in that window (the
    reconcile at a restart, chaos seed 14042) found the drain task still running, so started none, and the task
    then ended: the block stayed owed with nothing draining (2 acked-durable blocks never reached the bucket).
    The drain now looks again after that flush."""
    mgr = manager(tmp_path)

    async def go() -> tuple[dict[str, int], bool]:
        await mgr.start()
        ow = mgr.owed_writes
        ow.every_s = 0.01
        ow.journal_delay_s = 3600.0  # only the drain's own flushes write the journal, as between a daemon's batches
        flush, last_flush = ow.flush, asyncio.Event()

        async def slow_flush() -> None:  # a slow disk, in the drain's flush once nothing is owed: the window
            if not ow.counts() and not last_flush.is_set():
                last_flush.set()
                await asyncio.sleep(0.3)
            await flush()

        ow.flush = slow_flush  # type: ignore[method-assign]
        for i in (1, 2):
            await mgr.put(key(i), bytes([i]) * SLOT, cascade=False)  # in G2 only: owed to G3
        ow.owe("G3", key(1))
        await asyncio.wait_for(last_flush.wait(), 30)  # key 1 paid; the drain flushes its paid line
        ow.owe("G3", key(2))  # while that flush runs
        deadline = time.monotonic() + 30
        while ow.counts() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        counts, held = ow.counts(), mgr.where(key(2)) == ["G2", "G3"]
        await ow.close()
        for tier in mgr.tiers:
            await tier.close()
        return counts, held

    counts, held = asyncio.run(go())
    assert counts == {} and held, f"still owed {counts}, key 2 held in G2 and G3: {held}"
