"""G2: a pre-allocated pool of host slots in shared memory, pinned for DMA on CUDA hosts.

The pool is a file in /dev/shm mapped with mmap, so another process (a vLLM worker, the daemon) maps
the same slots by name with :meth:`HostTier.attach` and copies into/out of them without a socket hop.

Every pool the daemon creates gets a random ``generation``. A fixed ``host.shm_name`` reappears after a
restart, but as a new file: a worker compares generations, not names, to know its mapping is current.
The owner holds an exclusive flock on the pool file while it lives; that lock, not a PID in the name
(PIDs differ across PID namespaces), is what tells a live pool from one left by a dead owner. The pool
is fully allocated (``posix_fallocate``) at creation, so a too-small /dev/shm fails there with a clear
error instead of a SIGBUS in a worker that touches a slot later.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import time
from pathlib import Path

import torch

from kvbm.errors import KvbmError
from kvbm.tiers.pool import SlotPoolTier

log = logging.getLogger(__name__)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current
_PINNED_BY: dict[int, str] = {}  # pool address -> the runtime that pinned it (it unpins it too)

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def shm_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return SHM_DIR / name


def _locked_by_other(fd: int) -> bool:
    """Whether another open file description holds the owner's flock (the owner lives)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def remove_stale_pools() -> list[str]:
    """Unlink G2 pools (``kvbm-g2-*``) in shared memory whose owner died (e.g. kill -9).

    Dead means "nobody holds the owner's flock": a PID in the name says nothing about a daemon in
    another PID namespace sharing /dev/shm.
    """
    removed = []
    # Also half-built pools (``_create`` died before linking one into place).
    for path in [*SHM_DIR.glob("kvbm-g2-*"), *SHM_DIR.glob(".kvbm-new-*")]:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            # A half-built pool gets a minute: its creator may be between creating and locking it.
            young = path.name.startswith(".") and time.time() - os.fstat(fd).st_mtime < 60
            if young or _locked_by_other(fd):
                continue
            if os.stat(path).st_ino != os.fstat(fd).st_ino:  # a new owner replaced it meanwhile
                continue
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _allocate(fd: int, size: int, name: str) -> None:
    """Back all ``size`` bytes of the pool now; a full /dev/shm is an error here, not a SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: size it sparse
            os.ftruncate(fd, size)
            return
        try:
            st = os.statvfs(SHM_DIR)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB"
        except OSError:
            free = "free space unknown"
        raise KvbmError(
            f"G2 pool {name}: cannot allocate {size / 2**20:.0f} MiB of shared memory in {SHM_DIR} ({free}): "
            f"{os.strerror(e.errno or 0)}. Enlarge it (Docker: --shm-size) or lower host.capacity."
        ) from None


def _pin(ptr: int, size: int) -> bool:
    """Page-lock host memory for async DMA (cudaHostRegister, portable); False where CUDA is absent.

    Through cuda-python's cuda-bindings when installed (the cu12/cu13 extras): the daemon pins its pool with
    the flags it wants without a torch CUDA context. Else through torch's own CUDA runtime bindings."""
    from kvbm.transfer import cuda_rt

    if cuda_rt.runtime() is not None:
        err = cuda_rt.host_register(ptr, size, portable=True)
        if not err:
            _PINNED_BY[ptr] = "cuda-bindings"
            return True
        if not cuda_rt.no_gpu(err):
            log.warning("cudaHostRegister failed (%s); G2 stays pageable", err)
            return False
        # No GPU for cuda-bindings' CUDA (or a driver older than it): torch's runtime may still have one.
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        log.warning("cudaHostRegister failed (%s); G2 stays pageable", err)
        return False
    return True


def _unpin(ptr: int) -> None:
    from kvbm.transfer import cuda_rt

    if _PINNED_BY.pop(ptr, "") == "cuda-bindings":
        cuda_rt.host_unregister(ptr)
    else:
        torch.cuda.cudart().cudaHostUnregister(ptr)


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
        # Random per creation; attached mappings learn it from the daemon (Registered), not the file.
        self.generation = secrets.token_hex(8) if create else ""
        path = shm_path(self.shm_name)
        self._lock_fd: int | None = None
        fd = self._create(path, size) if create else os.open(path, os.O_RDWR)
        try:
            if not create and os.fstat(fd).st_size < size:
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

    def _create(self, path: Path, size: int) -> int:
        """Create the pool file, locked and fully allocated, taking over one left behind by an owner
        that died (e.g. kill -9).

        The file is built under a temporary name and linked into place, so the name never shows a pool
        that is not yet locked (``remove_stale_pools`` would take it for dead) or not yet allocated. A
        pool whose lock can be taken has no owner and is replaced; one whose cannot is an error.
        """
        self._check_not_in_use(path)  # before allocating: a live pool of this name is the error to report
        tmp = SHM_DIR / f".kvbm-new-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _allocate(fd, size, self.shm_name)
            try:
                os.link(tmp, path)
            except FileExistsError:
                old = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    if _locked_by_other(old):
                        raise self._in_use()
                    log.warning("G2: replacing pool %s left by a process that died", self.shm_name)
                    os.replace(tmp, path)  # atomic: the name goes straight from the dead pool to ours
                finally:
                    os.close(old)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        tmp.unlink(missing_ok=True)
        return fd

    def _in_use(self) -> FileExistsError:
        return FileExistsError(f"shared pool {self.shm_name} is in use by a running process")

    def _check_not_in_use(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            if _locked_by_other(fd):
                raise self._in_use()
        finally:
            os.close(fd)

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
