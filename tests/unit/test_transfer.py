"""kvbm.transfer: memory movers and block-file I/O, NIXL and plain, O_DIRECT and its fallback."""

import errno
import mmap
import os

import numpy as np
import pytest
import torch
from needs import needs, skip

from kvbm import transfer
from kvbm.blocks import ALIGNED_HEADER_LEN, BlockKey, pack_header, unpack_header, verify
from kvbm.config import TransferConfig
from kvbm.errors import CorruptBlockError
from kvbm.transfer import (
    NixlFileIO,
    NixlMemoryMover,
    PlainFileIO,
    TorchMemoryMover,
    TransferBackendError,
    fileio,
    make_file_io,
    make_memory_mover,
    nixl_agent,
    nixl_available,
)

MiB = 1 << 20
KEY = BlockKey("m-0123456789abcdef", bytes(range(16)))
HAVE_NIXL = nixl_available()[0]
needs_nixl = needs("nixl", HAVE_NIXL, f"NIXL unavailable: {nixl_available()[1]}")


def _movers():
    return list(_movers_gen())


def _movers_gen():
    yield pytest.param(TorchMemoryMover, id="torch")
    yield pytest.param(NixlMemoryMover, id="nixl", marks=needs_nixl)


def _file_ios():
    return list(_file_ios_gen())


def _file_ios_gen():
    yield pytest.param(PlainFileIO, id="plain")
    yield pytest.param(NixlFileIO, id="nixl", marks=needs_nixl)


@pytest.fixture(scope="module")
def nixl_file_io():
    return NixlFileIO() if HAVE_NIXL else None


@pytest.mark.parametrize("cls", _movers())
def test_memory_mover_copies_batch_exactly(cls):
    mover = cls()
    src = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8)
    dst = torch.zeros(8 * MiB, dtype=torch.uint8)
    mover.register(src)
    mover.register(dst)
    mover.register(src)  # registering twice is harmless
    # 6 blocks of 1 MiB, scattered and reversed, one copy call.
    pairs = [(src[i * MiB : (i + 1) * MiB], dst[(7 - i) * MiB : (8 - i) * MiB]) for i in range(6)]
    mover.copy(pairs)
    for s, d in pairs:
        assert torch.equal(s, d)
    assert not dst[: 2 * MiB].any()  # nothing outside the destinations was touched
    mover.close()


@needs_nixl
def test_nixl_mover_rejects_unregistered_and_mismatched():
    mover = NixlMemoryMover()
    a = torch.zeros(MiB, dtype=torch.uint8)
    mover.register(a)
    with pytest.raises(ValueError, match="not inside a pool"):
        mover.copy([(a[:100], torch.zeros(100, dtype=torch.uint8))])
    with pytest.raises(ValueError):
        mover.copy([(a[:100], a[200:300 + 1])])
    mover.close()


@needs_nixl
def test_a_nixl_movers_progress_thread_ends_when_its_manager_closes():
    import asyncio
    import threading

    from kvbm.manager import BlockManager
    from kvbm.tiers.host import HostTier

    def pumps() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "kvbm-dst-progress")

    before = pumps()
    mgr = BlockManager([HostTier(4 * MiB, MiB)], NixlMemoryMover())
    assert pumps() == before + 1  # the WRITEs' target is progressed by a thread of its own (no NIXL spin thread)

    async def run() -> None:
        await mgr.start(index=False)
        await mgr.close()

    asyncio.run(run())
    assert pumps() == before  # the manager closed its mover: the thread and the registrations are gone


@needs_nixl
def test_a_process_exiting_with_a_progress_pump_never_stopped_exits_cleanly():
    """An owner that never closed its mover (a worker torn down, a test) must not abort the process at exit: the
    pump's thread inside NIXL then hit ``std::terminate`` (rc 134, 6 of 6 runs at period 0 before the fix)."""
    import subprocess
    import sys

    code = ("import time\n"
            "from kvbm.transfer.nixl_agent import ProgressPump, new_agent, require_nixl\n"
            "pump = ProgressPump(new_agent(require_nixl(), 'exit-test', 'UCX'), 'exit-test', period_s=0.0)\n"
            "time.sleep(0.2)\n")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


def _payload(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


def _aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, n))


@pytest.mark.parametrize("cls", _file_ios())
@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("n", [MiB, MiB + 123])
def test_file_io_round_trip(cls, o_direct, n, tmp_path, nixl_file_io):
    fio = nixl_file_io if cls is NixlFileIO else cls()
    pl = _payload(n)
    header = pack_header(KEY, memoryview(pl), ALIGNED_HEADER_LEN)
    path = str(tmp_path / "b.kvb")
    size = fio.write_block(path, header, memoryview(pl), fsync=True, o_direct=o_direct)
    assert os.path.getsize(path) == size
    for read_direct in (False, True):
        for out in (None, _aligned(2 * MiB), memoryview(bytearray(n + 7))[3:]):
            head, view = fio.read_block(path, out, read_direct)
            assert head[: len(header)] == header
            verify(KEY, unpack_header(head), view)
            assert bytes(view) == pl.tobytes()


def test_o_direct_mode_recorded_and_padded(tmp_path):
    fio = PlainFileIO()
    pl = _payload(MiB + 1)
    header = pack_header(KEY, memoryview(pl), ALIGNED_HEADER_LEN)
    path = str(tmp_path / "d.kvb")
    size = fio.write_block(path, header, memoryview(pl), fsync=False, o_direct=True)
    if fio.last_write_mode != "direct":
        skip("odirect", "this filesystem refuses O_DIRECT")
    assert size == ALIGNED_HEADER_LEN + MiB + 4096 == os.path.getsize(path)  # padded to a page multiple
    # An aligned, page-multiple buffer is read into directly; anything else via the bounce buffer.
    fio.read_block(path, _aligned(2 * MiB), True)
    fio.read_block(path, None, True)
    assert fio.modes["write:direct"] == 1
    assert fio.modes["read:direct+bounce"] == 2  # MiB + 1 is not a page multiple
    pl2 = _payload(MiB)
    fio.write_block(path + "2", pack_header(KEY, memoryview(pl2), ALIGNED_HEADER_LEN), memoryview(pl2), False, True)
    _, view = fio.read_block(path + "2", _aligned(MiB), True)
    assert fio.modes["read:direct"] == 1 and bytes(view) == pl2.tobytes()


def test_o_direct_einval_falls_back_to_buffered(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & transfer.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    fio = PlainFileIO()
    pl = _payload(MiB + 5)
    header = pack_header(KEY, memoryview(pl), ALIGNED_HEADER_LEN)
    path = str(tmp_path / "f.kvb")
    size = fio.write_block(path, header, memoryview(pl), fsync=True, o_direct=True)
    assert fio.last_write_mode == "buffered" and size == len(header) + len(pl)
    _, view = fio.read_block(path, None, o_direct=True)
    assert bytes(view) == pl.tobytes()
    assert fio.modes == {"write:buffered": 1, "read:buffered": 1}
    assert len(fio._no_direct) == 1  # remembered: the next call doesn't try again


def test_o_direct_einval_on_write_falls_back(tmp_path, monkeypatch):
    real = fileio._pwrite_all
    calls = []

    def fail_direct(fd, bufs, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & transfer.O_DIRECT:
            calls.append(1)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    monkeypatch.setattr(fileio, "_pwrite_all", fail_direct)
    fio = PlainFileIO()
    pl = _payload(MiB)
    path = str(tmp_path / "g.kvb")
    size = fio.write_block(path, pack_header(KEY, memoryview(pl), ALIGNED_HEADER_LEN), memoryview(pl), True, True)
    if not calls:
        skip("odirect", "this filesystem refuses O_DIRECT at open")
    assert fio.last_write_mode == "buffered" and os.path.getsize(path) == size == ALIGNED_HEADER_LEN + MiB
    assert bytes(fio.read_block(path)[1]) == pl.tobytes()


def test_read_block_rejects_truncated_and_bad_header(tmp_path):
    fio = PlainFileIO()
    pl = _payload(MiB)
    path = str(tmp_path / "t.kvb")
    fio.write_block(path, pack_header(KEY, memoryview(pl), ALIGNED_HEADER_LEN), memoryview(pl), False, False)
    with pytest.raises(ValueError, match="too small"):
        fio.read_block(path, memoryview(bytearray(10)))
    os.truncate(path, ALIGNED_HEADER_LEN + MiB - 1)
    with pytest.raises(CorruptBlockError):
        fio.read_block(path)
    with open(path, "r+b") as f:
        f.write(b"XXXX")
    with pytest.raises(CorruptBlockError):
        fio.read_block(path)


def test_backend_selection(monkeypatch):
    assert make_memory_mover(TransferConfig(backend="plain")).name == "torch"
    assert make_file_io(TransferConfig(backend="plain")).name == "posix"
    if HAVE_NIXL:
        assert make_memory_mover(TransferConfig(backend="auto")).name == "torch"  # memcpy beats UCX in-process
        assert make_memory_mover(TransferConfig(backend="nixl")).name == "nixl-ucx"
        assert make_file_io(TransferConfig(backend="nixl")).name == "nixl-posix"
    monkeypatch.setattr(nixl_agent, "nixl_available", lambda: (False, "ImportError: no module named nixl"))
    for make in (make_memory_mover, make_file_io):
        with pytest.raises(TransferBackendError, match=r"'nixl' but NIXL is unavailable.*no module named nixl"):
            make(TransferConfig(backend="nixl"))
    assert make_memory_mover(TransferConfig(backend="auto")).name == "torch"
    assert make_file_io(TransferConfig(backend="auto")).name == "posix"


def test_nixl_probe_is_cached():
    assert nixl_available() is nixl_available()


def test_torch_mover_other_dtypes_and_layouts():
    mover = TorchMemoryMover()
    a = torch.randn(4, 256, dtype=torch.bfloat16)
    b = torch.empty(1024, dtype=torch.bfloat16)
    c = torch.empty(256, 4, dtype=torch.float32)
    mover.copy([(a, b), (a.t(), c)])  # byte copy (same dtype, contiguous); converting copy_ otherwise
    assert torch.equal(b.view(4, 256), a) and torch.equal(c, a.t().float())
