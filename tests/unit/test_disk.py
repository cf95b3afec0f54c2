"""G3 DiskTier: round trips, re-index, corruption, torn writes, ENOSPC (no GPU, plain asyncio)."""

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from needs import needs
from tmpfs_mount import mounted_tmpfs

from kvbm.blocks import ALIGNED_HEADER_LEN, BlockKey
from kvbm.errors import TierFullError
from kvbm.tiers.disk import DiskTier
from kvbm.transfer import NixlFileIO, PlainFileIO, nixl_available

KiB, MiB = 1 << 10, 1 << 20
NS = "m-0123456789abcdef"
BLOCK = 256 * KiB
HAVE_NIXL = nixl_available()[0]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def k(i: int, ns: str = NS) -> BlockKey:
    return BlockKey(ns, i.to_bytes(16, "big"))


def data(i: int, n: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def run(coro):
    return asyncio.run(coro)


async def started(path, capacity=64 * MiB, file_io=None, **kw) -> DiskTier:
    tier = DiskTier(path, capacity, file_io or PlainFileIO(), **kw)
    await tier.start()
    return tier


_NIXL_IO = []


def nixl_io():
    if not _NIXL_IO:
        _NIXL_IO.append(NixlFileIO())
    return _NIXL_IO[0]


FILE_IOS = [
    pytest.param(PlainFileIO, id="plain"),
    pytest.param(nixl_io, id="nixl", marks=needs("nixl", HAVE_NIXL, f"NIXL unavailable: {nixl_available()[1]}")),
]


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("make_io", FILE_IOS)
def test_round_trip_scan_delete(tmp_path, make_io, o_direct):
    async def main():
        tier = await started(tmp_path, file_io=make_io(), o_direct=o_direct)
        await asyncio.gather(*(tier.put(k(i), data(i)) for i in range(6)))
        await tier.put(k(6), memoryview(data(6, 1000)))  # odd size
        assert tier.nbytes(k(0)) == BLOCK and tier.nbytes(k(6)) == 1000
        assert tier.used_bytes() == 6 * tier.footprint(BLOCK) + tier.footprint(1000)
        assert tier.footprint(1000) == ALIGNED_HEADER_LEN + 4096
        for i in range(6):
            out = bytearray(BLOCK)
            assert await tier.get_into(k(i), memoryview(out)) == BLOCK
            assert bytes(out) == data(i)
        assert await tier.get(k(6)) == data(6, 1000)
        assert await tier.get(k(99)) is None
        assert tier.path_for(k(1)) == tmp_path / NS / k(1).hex[:2] / f"{k(1).hex}.kvb"
        assert tier.path_for(k(1)).is_file()
        got = [b async for b in tier.scan()]
        assert {b.key for b in got} == {k(i) for i in range(7)}
        assert all(b.footprint == tier.footprint(b.nbytes) and b.mtime > 0 for b in got)
        await tier.put(k(0), data(100))  # replace
        assert await tier.get(k(0)) == data(100)
        assert await tier.delete(k(1)) and not await tier.delete(k(1))
        assert not tier.path_for(k(1)).exists()
        assert tier.used_bytes() == 5 * tier.footprint(BLOCK) + tier.footprint(1000)
        assert tier.stats.puts == 8 and tier.stats.deletes == 1 and tier.stats.corrupt == 0
        assert tier.drop_page_cache(k(2)) and await tier.get(k(2)) == data(2)
        assert not [p for p in tier.dir.rglob(".tmp-*")]
        await tier.close()

    run(main())


def test_restart_reindexes(tmp_path):
    async def main():
        tier = await started(tmp_path)
        for i in range(5):
            await tier.put(k(i), data(i))
        await tier.put(k(7, "other-fedcba9876543210"), data(7))
        used = tier.used_bytes()
        await tier.close()
        again = await started(tmp_path)
        assert again.used_bytes() == used
        assert {b.key async for b in again.scan()} == {k(i) for i in range(5)} | {k(7, "other-fedcba9876543210")}
        assert await again.get(k(3)) == data(3)
        assert await again.get(k(7, "other-fedcba9876543210")) == data(7)
        await again.close()

    run(main())


def test_io_runs_off_the_event_loop(tmp_path):
    threads = set()
    fio = PlainFileIO()
    for name in ("write_block", "read_block", "read_header"):
        real = getattr(fio, name)

        def spy(*a, _real=real, **kw):
            threads.add(threading.current_thread().name)
            return _real(*a, **kw)

        setattr(fio, name, spy)

    async def main():
        tier = await started(tmp_path, file_io=fio)
        await tier.put(k(1), data(1))
        assert await tier.get(k(1)) == data(1)
        await tier.close()

    run(main())
    assert threads and all(t.startswith("kvbm-disk") for t in threads)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_payload_is_a_miss_and_removed(tmp_path):
    async def main():
        tier = await started(tmp_path)
        await tier.put(k(1), data(1))
        await tier.put(k(2), data(2))
        _flip(tier.path_for(k(1)), ALIGNED_HEADER_LEN + 1234)
        out = bytearray(BLOCK)
        assert await tier.get_into(k(1), memoryview(out)) is None
        assert tier.stats.corrupt == 1 and tier.stats.misses == 1
        assert not tier.path_for(k(1)).exists() and not tier.contains(k(1))
        assert tier.used_bytes() == tier.footprint(BLOCK)
        assert await tier.get(k(2)) == data(2)

    run(main())


def test_corrupt_header_and_truncated_file_dropped_at_reindex(tmp_path):
    async def main():
        tier = await started(tmp_path)
        for i in range(4):
            await tier.put(k(i), data(i))
        await tier.close()
        _flip(tier.path_for(k(0)), 20)  # header byte
        os.truncate(tier.path_for(k(1)), ALIGNED_HEADER_LEN + BLOCK - 1)  # payload cut short
        os.truncate(tier.path_for(k(2)), 100)  # header cut short
        (tmp_path / NS / "zz").mkdir()
        (tmp_path / NS / "zz" / "notes.txt").write_text("not a block")  # foreign file: left alone
        again = await started(tmp_path)
        assert {b.key async for b in again.scan()} == {k(3)}
        assert again.stats.corrupt == 3
        assert not again.path_for(k(0)).exists() and not again.path_for(k(1)).exists()
        assert (tmp_path / NS / "zz" / "notes.txt").exists()
        assert await again.get(k(1)) is None

    run(main())


def test_truncated_after_indexing_is_a_miss(tmp_path):
    async def main():
        tier = await started(tmp_path)
        await tier.put(k(1), data(1))
        os.truncate(tier.path_for(k(1)), ALIGNED_HEADER_LEN + 10)
        assert await tier.get(k(1)) is None
        assert tier.stats.corrupt == 1 and not tier.contains(k(1))

    run(main())


def test_wrong_hash_or_fingerprint_in_header_is_a_miss(tmp_path):
    other_ns = "m-fedcba9876543210"

    async def main():
        tier = await started(tmp_path)
        await tier.put(k(1), data(1))
        await tier.put(k(2, other_ns), data(2))
        # Block 2's file (another layout fingerprint) and block 1's file (another hash) moved into
        # the places of blocks 3 and 4: their headers name other blocks.
        for src, dst in ((k(2, other_ns), k(3)), (k(1), k(4))):
            tier.path_for(dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tier.path_for(src), tier.path_for(dst))
        await tier.close()
        again = await started(tmp_path)  # re-index drops both
        assert not again.contains(k(3)) and not again.contains(k(4)) and again.stats.corrupt == 2
        # And at read time, when a file changes underneath the index:
        shutil.copy(again.path_for(k(1)), again.path_for(k(2, other_ns)))
        assert await again.get(k(2, other_ns)) is None
        assert again.stats.corrupt == 3 and not again.path_for(k(2, other_ns)).exists()
        assert await again.get(k(1)) == data(1)

    run(main())


def test_leftover_temp_file_invisible_and_cleaned(tmp_path):
    async def main():
        tier = await started(tmp_path)
        await tier.put(k(1), data(1))
        await tier.close()
        shard = tier.path_for(k(1)).parent
        torn = shard / ".tmp-12345-abcdef"
        torn.write_bytes(tier.path_for(k(1)).read_bytes()[: ALIGNED_HEADER_LEN + 100])
        again = await started(tmp_path)
        assert not torn.exists() and again.tmp_removed == 1
        assert {b.key async for b in again.scan()} == {k(1)}

    run(main())


def test_crash_mid_write_leaves_no_torn_block(tmp_path):
    """A writer process killed between the header and the payload leaves only a temp file."""
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys, time
        from kvbm.tiers.disk import DiskTier
        from kvbm.transfer import PlainFileIO
        from kvbm.blocks import BlockKey
        import kvbm.transfer.fileio as t

        real = t._pwrite_all
        def slow(fd, bufs, offset):
            real(fd, [bufs[0]], offset)           # the header (or the whole aligned buffer) lands
            os.fsync(fd)
            print("WRITING", flush=True)
            time.sleep(60)                        # ...and the process dies here
        t._pwrite_all = slow

        async def main():
            tier = DiskTier({str(tmp_path)!r}, 1 << 30, PlainFileIO(), o_direct=False)
            await tier.start()
            await tier.put(BlockKey({NS!r}, (5).to_bytes(16, "big")), b"x" * {BLOCK})
        asyncio.run(main())
        """
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == b"WRITING"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    temps = list(tmp_path.rglob(".tmp-*"))
    assert len(temps) == 1 and not list(tmp_path.rglob("*.kvb"))

    async def main():
        tier = await started(tmp_path)
        assert not tier.contains(k(5)) and tier.tmp_removed == 1 and tier.stats.corrupt == 0
        assert not list(tmp_path.rglob(".tmp-*"))

    run(main())


def test_capacity_full_raises(tmp_path):
    async def main():
        tier = await started(tmp_path, capacity=3 * (ALIGNED_HEADER_LEN + BLOCK))
        for i in range(3):
            await tier.put(k(i), data(i))
        with pytest.raises(TierFullError):
            await tier.put(k(3), data(3))
        await tier.put(k(0), data(10))  # replacing a block fits
        assert tier.stats.shed == 1 and not tier.contains(k(3))

    run(main())


def test_enospc_monkeypatched_raises_tier_full_and_cleans_up(tmp_path, monkeypatch):
    import kvbm.transfer.fileio as t

    async def main():
        tier = await started(tmp_path)
        await tier.put(k(1), data(1))

        def full(*a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(t, "_pwrite_all", full)
        with pytest.raises(TierFullError):
            await tier.put(k(2), data(2))
        monkeypatch.undo()
        assert not tier.contains(k(2)) and not list(tmp_path.rglob(".tmp-*"))
        assert await tier.get(k(1)) == data(1)
        assert tier.used_bytes() == tier.footprint(BLOCK)

    run(main())


@pytest.fixture
def tiny_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "1m") as mnt:
        yield mnt


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("make_io", FILE_IOS)
def test_enospc_on_real_tmpfs(tiny_tmpfs, make_io, o_direct):
    async def main():
        tier = await started(tiny_tmpfs, capacity=1 << 30, file_io=make_io(), o_direct=o_direct)
        await tier.put(k(1), data(1))  # 260 KiB of the 1 MiB
        with pytest.raises(TierFullError):
            for i in range(2, 10):
                await tier.put(k(i), data(i))
        assert not list(tiny_tmpfs.rglob(".tmp-*"))
        assert await tier.get(k(1)) == data(1)
        stored = {b.key async for b in tier.scan()}
        await tier.close()
        again = await started(tiny_tmpfs)
        assert {b.key async for b in again.scan()} == stored and again.stats.corrupt == 0
        await again.close()

    run(main())


def test_bad_namespace_rejected(tmp_path):
    tier = DiskTier(tmp_path, MiB, PlainFileIO())
    with pytest.raises(ValueError):
        tier.path_for(BlockKey("../x-0123456789abcdef", b"1"))
