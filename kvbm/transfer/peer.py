"""The NIXL agent a daemon reads other daemons' G2 pools with (peer reads, :mod:`kvbm.daemon.peer_reads`).

One UCX agent per daemon, its G2 pool registered once: its metadata (handed to a peer over the authenticated
peer-read socket, never through the bucket) lets that peer READ from this pool; a peer's metadata added here lets
this daemon READ from the peer's. A READ is one-sided: the serving daemon's CPU does not copy the bytes. Every
call blocks (run it in a thread); the agent is in strict thread-sync mode, so threads may share it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import secrets
import threading
from collections.abc import Sequence

import torch

from kvbm.transfer.nixl_agent import ProgressPump, TransferBackendError, new_agent, require_nixl, wait_xfer

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
POPULATE_CHUNK = 64 << 20  # bytes mapped per madvise by the background populate
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def prefault(addr: int, nbytes: int) -> bool:
    """Map the pages of ``[addr, addr + nbytes)`` writable in this process's page tables now, changing no byte
    (``MADV_POPULATE_WRITE``). A UCX shared-memory (CMA) READ into pages this process never touched ran 10-50x
    slower than into mapped ones (256 MiB: 3.5-14 s against 0.2-0.3 s, and 0.2 s to map them first). False where
    the kernel lacks it (before 5.14): the READ maps them itself, slowly."""
    start = addr - addr % mmap.PAGESIZE
    return _libc.madvise(start, addr + nbytes - start, _MADV_POPULATE_WRITE) == 0


class PeerAgent:
    """This daemon's NIXL UCX agent for peer reads, with ``pool`` (its G2) registered."""

    def __init__(self, pool: torch.Tensor) -> None:
        api = require_nixl()
        try:
            self._agent = new_agent(api, f"kvbm-p2p-{secrets.token_hex(4)}", "UCX")  # unique across hosts too
        except Exception as e:
            raise TransferBackendError(f"NIXL UCX backend does not create (peer reads): {e}") from e
        self.name: str = self._agent.name
        self.pool_addr = pool.data_ptr()
        self._reg = self._agent.register_memory(pool)
        self._lock = threading.Lock()
        self._remotes: set[str] = set()
        self._mapped: dict[int, int] = {}  # local address -> bytes from it prefaulted (a slot: once for good)
        self._pump = ProgressPump(self._agent, "kvbm-p2p-progress")  # peers connect to and read from this agent
        # The whole pool mapped now, in the background: a READ into slots not mapped yet paid for mapping them
        # (256 MiB: ~0.15 s of a 0.2 s READ in vLLM's server), on the critical path of the lookup that waits for it.
        self.populated = threading.Event()
        self._closing = threading.Event()
        self._populate_thread = threading.Thread(target=self._populate, args=(self.pool_addr, pool.numel()
                                                                              * pool.element_size()),
                                                 name="kvbm-p2p-populate", daemon=True)
        self._populate_thread.start()

    def _populate(self, addr: int, nbytes: int) -> None:
        """Map the pool's pages, ``POPULATE_CHUNK`` at a time (a close stops it between chunks)."""
        for off in range(0, nbytes, POPULATE_CHUNK):
            if self._closing.is_set() or not prefault(addr + off, min(POPULATE_CHUNK, nbytes - off)):
                return  # closing, or a kernel without MADV_POPULATE_WRITE: each READ maps its slots
        self.populated.set()

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Know a peer's agent (its registered pool); returns its name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if name in self._remotes:
                self._remotes.discard(name)
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # already gone: nothing to forget
                    pass

    def read(self, remote: str, pairs: Sequence[tuple[int, int, int]], timeout_s: float) -> None:
        """One READ of ``(local address, remote address, bytes)`` triples from agent ``remote``'s registered
        memory into this pool (its pages mapped first, once: :func:`prefault`); raises OSError (the transfer
        failed: a dead peer) or TransferBackendError (not done within ``timeout_s``)."""
        if not pairs:
            return
        if not self.populated.is_set():
            for la, _ra, n in pairs:
                if self._mapped.get(la, 0) < n:
                    prefault(la, n)
                    self._mapped[la] = n
        local = [(la, n, 0) for la, _ra, n in pairs]
        far = [(ra, n, 0) for _la, ra, n in pairs]
        with self._lock:
            try:
                handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                                     self._agent.get_xfer_descs(far, "DRAM"), remote)
            except Exception as e:  # NIXL's own errors (a remote not loaded, a bad descriptor): a failed read
                raise OSError(errno.EIO, f"peer READ from {remote} could not start: {e}") from e
        wait_xfer(self._agent, handle, f"peer READ of {len(pairs)} blocks from {remote}", timeout_s)

    def close(self) -> None:
        self._closing.set()
        self._populate_thread.join(5.0)
        with self._lock:
            for name in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None
        self._pump.stop()  # last: closing the endpoints to the peers may need progress
