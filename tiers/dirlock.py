"""The disk directory's owner lock (``<dir>/.kvbm.lock``): one daemon owns a G3 directory; maintenance commands
that delete take it shared, so they cannot run behind a daemon's back (see :mod:`kvbm.tiers.disk`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from pathlib import Path

from kvbm.errors import ConfigError, KvbmError

LOCK_FILE = ".kvbm.lock"


class DiskDirBusy(KvbmError):
    """Another process holds the disk directory's lock."""


class DirLock:
    """``flock`` on ``<dir>/.kvbm.lock``: exclusive for the owning tier, shared for deleting maintenance.

    The exclusive holder writes its pid and command line into the file, so the error a second process
    gets names the owner. The kernel drops the lock when the holder exits, however it exits."""

    def __init__(self, dir: str | os.PathLike[str]) -> None:
        self.dir = Path(dir)
        self.path = self.dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, *, shared: bool = False) -> DirLock:
        """Take the lock without waiting; :class:`DiskDirBusy` if another process holds it."""
        if self._fd is not None:
            return self
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:  # read-only, immutable, not ours: say which setting names it, not a traceback
            raise ConfigError(f"disk.dir {self.dir}: cannot open its lock file {LOCK_FILE} ({e.strerror}); make the "
                              f"directory writable, point disk.dir (KVBM_DISK_DIR) elsewhere, or set disk.enabled: "
                              f"false") from None
        self._flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n{_cmdline(os.getpid())}\n".encode(), 0)
        self._fd = fd
        return self

    def claim(self) -> str | None:
        """The owning tier's start: the exclusive lock, and None; for a directory it cannot write (:func:`unwritable`),
        the lock taken read-only (:meth:`acquire_read_only`) and why it cannot be written."""
        why = unwritable(self.dir)
        (self.acquire if why is None else self.acquire_read_only)()
        return why

    def acquire_read_only(self) -> DirLock:
        """The exclusive lock of a directory this process cannot write (read-only, immutable): taken through an
        existing lock file opened for reading (``flock`` needs no write access), so a second daemon still fails with
        :class:`DiskDirBusy`. With no lock file there is nothing to lock, and nobody can write there either."""
        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self
        except OSError as e:
            raise ConfigError(f"disk.dir {self.dir}: cannot read its lock file {LOCK_FILE} ({e.strerror})") from None
        self._flock(fd, fcntl.LOCK_EX)
        self._fd = fd
        return self

    def _flock(self, fd: int, mode: int) -> None:
        """``flock`` without waiting; ``fd`` closed and :class:`DiskDirBusy` naming the holder if it is taken."""
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = self.owner(fd)
            os.close(fd)
            raise DiskDirBusy(f"disk directory {self.dir} is in use by another kvbm process ({owner})") from None
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def owner(self, fd: int | None = None) -> str:
        """Who holds it, as far as the file says: the exclusive owner's pid and command if it still runs."""
        try:
            if fd is not None:
                text = os.pread(fd, 4096, 0).decode(errors="replace")
            else:
                text = self.path.read_text(errors="replace")
        except OSError:
            text = ""
        first, _, rest = text.partition("\n")
        if first.strip().isdigit() and os.path.exists(f"/proc/{first.strip()}"):
            return f"pid {first.strip()}: {rest.strip() or '?'}"
        return "a kvbm maintenance command"

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def unwritable(dir: Path) -> str | None:
    """Why nothing can be written in ``dir`` (read-only filesystem, immutable, not ours), found by creating and
    removing an empty probe file; None when it can be. A full disk is not unwritable (its writes are shed).
    :class:`ConfigError` naming ``disk.dir`` when the directory cannot even be created."""
    try:
        dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"disk.dir {dir}: cannot create it ({e.strerror})") from None
    probe = dir / f".tmp-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return None
        return f"disk.dir {dir} cannot be written ({e.strerror})"
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return ""
