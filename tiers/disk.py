"""G3: one file per block on local disk.

Layout: ``<dir>/<namespace>/<hash_hex[:2]>/<hash_hex>.kvb`` holding ``header || payload`` (a 4 KiB
header so the payload is page-aligned for O_DIRECT). Writes go to ``.tmp-<pid>-<rand>`` in the same
directory, are fsynced, renamed over the final name and the directory is fsynced: a crash leaves
either the old block, the new one, or a temp file that :meth:`DiskTier.start` deletes — never a torn
block. Every file operation runs on a small thread pool, never on the event loop.

One process owns a directory: :meth:`DiskTier.start` takes an exclusive ``flock`` on ``<dir>/.kvbm.lock``
(held until :meth:`DiskTier.close`), so a second daemon (or ``kvbm demo``) on the same directory fails
with :class:`DiskDirBusy` naming the owner instead of re-indexing and deleting under it. Maintenance
commands read without the lock; ones that delete take it shared (:class:`DirLock`), so they cannot run
behind a daemon's back. A tier that is never started (``kvbm prewarm``) takes no lock: it only renames
complete files into place, which the owner picks up on refresh.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from kvbm.blocks import ALIGNED_HEADER_LEN, FLAG_PARTIAL, BlockKey, pack_header, unpack_header, verify
from kvbm.blocks.keys import DISK_SUFFIX, check_namespace, disk_relpath, parse_disk_relpath
from kvbm.errors import CorruptBlockError, TierFullError, TierUnavailableError
from kvbm.tiers.base import StoredBlock, Tier
from kvbm.tiers.dirlock import LOCK_FILE, DirLock, DiskDirBusy  # noqa: F401  (LOCK_FILE, DiskDirBusy: re-exported)
from kvbm.transfer import FileIO, PlainFileIO, round_up

log = logging.getLogger(__name__)

SUFFIX = DISK_SUFFIX
TMP_PREFIX = ".tmp-"
T = TypeVar("T")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier(Tier):
    name = "G3"
    kind = "disk"

    def __init__(
        self,
        dir: str | os.PathLike[str],
        capacity_bytes: int,
        file_io: FileIO | None = None,
        fsync: bool = True,
        o_direct: bool = True,
        header_len: int = ALIGNED_HEADER_LEN,
        *,
        io_threads: int = 4,
    ) -> None:
        super().__init__(capacity_bytes)
        self.dir = Path(dir)
        self.local_dir = self.dir  # the manager's journal of owed writes lives here too
        self.file_io = file_io or PlainFileIO()
        self.fsync = fsync
        self.o_direct = o_direct
        self.header_len = header_len
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvbm-disk")
        self._index: dict[BlockKey, tuple[int, float]] = {}  # key -> (payload bytes, mtime)
        self._partials: set[BlockKey] = set()  # blocks whose header says FLAG_PARTIAL
        self._used = 0
        self._reserved = 0  # footprint of puts in flight
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self.dir_lock = DirLock(self.dir)
        self.tmp_removed = 0  # leftover temp files deleted by start()

    # -- helpers -----------------------------------------------------------------------------------
    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def path_for(self, key: BlockKey) -> Path:
        return self.dir / disk_relpath(key)

    def footprint(self, nbytes: int) -> int:
        return self.header_len + round_up(nbytes)

    def used_bytes(self) -> int:
        return self._used

    def nbytes(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry[0]

    def _forget(self, key: BlockKey) -> bool:
        entry = self._index.pop(key, None)
        self._partials.discard(key)
        if entry is None:
            return False
        self._used -= self.footprint(entry[0])
        return True

    def _remember(self, key: BlockKey, nbytes: int, mtime: float) -> None:
        self._forget(key)
        self._index[key] = (nbytes, mtime)
        self._used += self.footprint(nbytes)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            # Own the directory before sweeping temp files and dropping blocks in it. One it cannot write is opened
            # read-only: indexed and served (and read to pay what it owes the bucket), nothing written or dropped.
            read_only = await self._io(self.dir_lock.claim)
            try:
                partials: set[BlockKey] = set()
                found, corrupt, tmp = await self._io(walk_blocks, self.dir, self.file_io, self.header_len, None,
                                                     read_only is None, partials)
            except BaseException:
                self.dir_lock.release()
                raise
            self.read_only = read_only
            self._index.clear()
            self._used = 0
            for key, (n, mtime) in found.items():
                self._remember(key, n, mtime)
            self._partials = partials
            self.stats.corrupt += corrupt
            self.tmp_removed += tmp
            self._started = True
            log.info("G3 %s: %d blocks (%d B), %d corrupt and %d temp files removed",
                     self.dir, len(found), self._used, corrupt, tmp)
            if read_only is not None:
                log.error("G3 is READ-ONLY for this run (%s): its %d blocks are served and paid to the tiers below, "
                          "nothing is written to it", read_only, len(found))

    async def refresh(self, namespace: str | None = None) -> None:
        """Index block files that other processes (``kvbm prewarm``) renamed into place since start."""
        partials: set[BlockKey] = set()
        found, corrupt, _ = await self._io(walk_blocks, self.dir, self.file_io, self.header_len, namespace, False,
                                           partials)
        for key, (n, mtime) in found.items():
            if key not in self._index:
                self._remember(key, n, mtime)
                if key in partials:
                    self._partials.add(key)
        self.stats.corrupt += corrupt

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.dir_lock.release()

    # -- data path ---------------------------------------------------------------------------------
    def writable(self) -> bool:
        return self.read_only is None

    async def put(self, key: BlockKey, data: memoryview | bytes) -> None:
        if self.read_only is not None:
            raise TierUnavailableError(f"G3 is read-only: {self.read_only}")
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        n = len(view)
        need = self.footprint(n)
        old = self._index.get(key)
        freed = self.footprint(old[0]) if old else 0
        if self._used + self._reserved - freed + need > self.capacity_bytes:
            self.stats.shed += 1
            raise TierFullError(
                f"G3 full: {self._used + self._reserved} of {self.capacity_bytes} B used, block needs {need}"
            )
        self._reserved += need
        flags = self.flags_of(key)
        try:
            mtime = await self._io(self._write, key, view, flags)
        except TierFullError:
            self.stats.shed += 1
            raise
        except BaseException:
            self.stats.errors += 1
            raise
        finally:
            self._reserved -= need
        self._remember(key, n, mtime)
        if flags & FLAG_PARTIAL:
            self._partials.add(key)
        self.stats.puts += 1
        self.stats.bytes_in += n

    def _write(self, key: BlockKey, view: memoryview, flags: int = 0) -> float:
        final = self.path_for(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        header = pack_header(key, view, self.header_len, flags=flags)
        try:
            self.file_io.write_block(str(tmp), header, view, self.fsync, self.o_direct)
            os.rename(tmp, final)
        except BaseException as e:
            _unlink(str(tmp))
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"G3: no space left on {self.dir} for {key}") from e
            raise
        if self.fsync:
            _fsync_dir(str(final.parent))
        return time.time()

    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        self.stats.gets += 1
        n = self.nbytes(key)
        if n is None:
            self.stats.misses += 1
            return None
        if len(out) < n:
            raise ValueError(f"buffer of {len(out)} bytes is too small for {key} ({n} bytes)")
        try:
            got = await self._io(self._read, key, out, n)
        except FileNotFoundError:
            self._forget(key)  # deleted underneath us
            got = None
        except CorruptBlockError as e:
            log.warning("G3: corrupt block %s removed: %s", key, e)
            self.stats.corrupt += 1
            self._forget(key)
            got = None
        except OSError:
            self.stats.errors += 1
            raise
        if got is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_out += got
        return got

    def _read(self, key: BlockKey, out: memoryview, n: int) -> int:
        path = str(self.path_for(key))
        try:
            ino = os.stat(path).st_ino
            head, payload = self.file_io.read_block(path, out, self.o_direct, self.header_len)
            verify(key, unpack_header(head), payload, expected_len=n)
        except (CorruptBlockError, ValueError) as e:
            # Remove it unless a concurrent put already replaced it with a new file.
            try:
                if os.stat(path).st_ino == ino:
                    _unlink(path)
            except (OSError, UnboundLocalError):
                pass
            raise CorruptBlockError(str(e)) from e
        return len(payload)

    async def delete(self, key: BlockKey) -> bool:
        return bool(await self.delete_blocks([key]))

    async def delete_blocks(self, keys: Sequence[BlockKey], *, gone: bool = False) -> int:
        """:meth:`delete` of many: the files unlinked in one job of the I/O pool (none when ``gone``). A block
        leaves the index only once its file is gone: a file that could not be unlinked (EROFS, EACCES) stays
        indexed, and :class:`TierUnavailableError` names how many and why (a restart would index it again)."""
        held = [k for k in dict.fromkeys(keys) if k in self._index]
        if held and not gone:
            paths = [str(self.path_for(k)) for k in held]
            errors = await self._io(_unlink_each, paths)
            failed = {k: e for k, e in zip(held, errors, strict=True) if e is not None}
            held = [k for k in held if k not in failed]
        else:
            failed = {}
        for k in held:
            self._forget(k)
        self.stats.deletes += len(held)
        if failed:
            first = next(iter(failed.values()))
            raise TierUnavailableError(f"{self.name}: {len(failed)} of {len(failed) + len(held)} block files could "
                                       f"not be removed ({first.strerror}: {first.filename}); they stay indexed")
        return len(held)

    # -- index -------------------------------------------------------------------------------------
    async def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:
        for key, (n, mtime) in list(self._index.items()):
            if namespace is not None and key.namespace != namespace:
                continue
            yield StoredBlock(key=key, nbytes=n, mtime=mtime, footprint=self.footprint(n),
                              partial=key in self._partials)

    # -- benchmarks --------------------------------------------------------------------------------
    def drop_page_cache(self, key: BlockKey) -> bool:
        """Evict a block file's pages from the page cache (for cold-read measurements)."""
        return drop_file_pages(self.path_for(key))

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.update(dir=str(self.dir), blocks=len(self._index), file_io=self.file_io.name,
                 io_modes=dict(self.file_io.modes), o_direct=self.o_direct, fsync=self.fsync)
        return d


def walk_blocks(
    top_dir: Path, file_io: FileIO, header_len: int, namespace: str | None = None, clean_tmp: bool = True,
    partials: set[BlockKey] | None = None,
) -> tuple[dict[BlockKey, tuple[int, float]], int, int]:
    """Walk the tree (or one namespace): verify each header against its file name and size; drop what
    fails; returns ({key: (payload bytes, mtime)}, corrupt files removed, temp files removed). Temp files are
    removed only at start, when no writer of ours can be mid-write. ``partials`` collects the blocks whose header
    says FLAG_PARTIAL."""
    top_dir.mkdir(parents=True, exist_ok=True)
    top = top_dir / check_namespace(namespace) if namespace else top_dir
    found: dict[BlockKey, tuple[int, float]] = {}
    corrupt = tmp = 0
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(root).relative_to(top_dir).parts
        for fname in files:
            path = os.path.join(root, fname)
            if fname.startswith(TMP_PREFIX):
                if clean_tmp:
                    tmp += _unlink(path)
                continue
            key = parse_disk_relpath((*rel, fname))
            if key is None:
                continue  # not a kvbm block name: never read, never deleted
            try:
                head, size = file_io.read_header(path, header_len)
                hdr = unpack_header(head)
                if hdr.hash != key.hash or hdr.fingerprint != key.fingerprint:
                    raise CorruptBlockError("header names another block")
                if not hdr.header_len + hdr.payload_len <= size <= hdr.header_len + round_up(hdr.payload_len):
                    raise CorruptBlockError(f"file is {size} bytes for a {hdr.payload_len}-byte payload")
                found[key] = (hdr.payload_len, os.stat(path).st_mtime)
                if partials is not None and hdr.flags & FLAG_PARTIAL:
                    partials.add(key)
            except FileNotFoundError:
                continue
            except (CorruptBlockError, ValueError) as e:
                log.warning("G3: dropping %s: %s", path, e)
                try:
                    corrupt += _unlink(path)
                except OSError as e2:  # a read-only directory: never indexed, left where it is
                    log.warning("G3: %s not removed: %s", path, e2.strerror)
    return found, corrupt, tmp


def drop_file_pages(path: Path) -> bool:
    """Evict a file's pages from the page cache; False if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _unlink_each(paths: list[str]) -> list[OSError | None]:
    """Unlink each path (one already gone counts as removed); the error of each that failed, else None."""
    out: list[OSError | None] = []
    for path in paths:
        try:
            os.unlink(path)
            out.append(None)
        except FileNotFoundError:
            out.append(None)
        except OSError as e:
            out.append(e)
    return out


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
