"""G2: a pre-allocated pool of host slots in shared memory, pinned for DMA on CUDA hosts.

The pool is a file in /dev/shm mapped with mmap, so another process (a vLLM worker, the daemon) maps
the same slots by name with :meth:`HostTier.attach` and copies into/out of them without a socket hop.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
from pathlib import Path

import torch

from kvbm.tiers.pool import SlotPoolTier

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def shm_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return SHM_DIR / name


def _pin(ptr: int, size: int) -> bool:
    """Page-lock host memory for async DMA (cudaHostRegister); False where CUDA is absent."""
    if not torch.cuda.is_available():
        return False
    from cuda.bindings import runtime as cudart

    (err,) = cudart.cudaHostRegister(ptr, size, cudart.cudaHostRegisterPortable)
    if err != cudart.cudaError_t.cudaSuccess:
        log.warning("cudaHostRegister failed (%s); G2 stays pageable", err)
        return False
    return True


def _unpin(ptr: int) -> None:
    from cuda.bindings import runtime as cudart

    cudart.cudaHostUnregister(ptr)


class HostTier(SlotPoolTier):
    """G2 slot pool backed by a named shared-memory mapping."""

    name = "G2"
    kind = "host"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        shm_name: str = "",
        pin: bool = True,
        *,
        create: bool = True,
    ) -> None:
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"G2 capacity {capacity_bytes} B holds no {slot_bytes}-byte block")
        size = num_slots * slot_bytes
        self.shm_name = shm_name or f"kvbm-g2-{os.getpid()}-{secrets.token_hex(4)}"
        self.owner = create
        path = shm_path(self.shm_name)
        self._lock_fd: int | None = None
        fd = self._create(path) if create else os.open(path, os.O_RDWR)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared pool {self.shm_name} is smaller than {size} bytes")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        if create:
            self._lock_fd = fd  # held open with its flock for as long as this process owns the pool
        else:
            os.close(fd)
        pool = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = pin and _pin(pool.data_ptr(), size)
        super().__init__(pool, slot_bytes)

    def _create(self, path: Path) -> int:
        """Create the pool file, taking over one left behind by an owner that died (e.g. kill -9).

        The owner holds an exclusive flock on the file while it lives, so a pool that can be locked
        has no owner and is replaced; one that cannot is in use and is an error.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise FileExistsError(f"shared pool {self.shm_name} is in use by a running process") from None
            os.close(fd)
            log.warning("G2: replacing pool %s left by a process that died", self.shm_name)
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    @classmethod
    def attach(cls, shm_name: str, capacity_bytes: int, slot_bytes: int, pin: bool = True) -> HostTier:
        """Map an existing pool created by another process (the daemon)."""
        return cls(capacity_bytes, slot_bytes, shm_name, pin, create=False)

    async def close(self) -> None:
        self.release()

    def release(self) -> None:
        if getattr(self, "_mm", None) is None:
            return
        if self.pinned:
            _unpin(self.pool.data_ptr())
        del self.pool
        try:
            self._mm.close()
        except BufferError:
            # A view into the pool is still alive somewhere; the mapping goes with the process.
            log.debug("G2 pool %s still referenced at close", self.shm_name)
        self._mm = None  # type: ignore[assignment]
        if self.owner:
            shm_path(self.shm_name).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.update(shm_name=self.shm_name, pinned=self.pinned, slot_bytes=self.slot_bytes, slots=self.num_slots)
        return d
