"""The owed-write journal (:mod:`kvbm.manager.owed`): the file in the disk tier's directory that says which
write-throughs are still owed, so a restart owes them again. Appended by a thread in batches, rewritten compactly
through a temporary file of a unique name, replayed at start."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kvbm.blocks import BlockKey
from kvbm.manager.state import ManagerState

log = logging.getLogger("kvbm.manager.owed")

JOURNAL_NAME = ".kvbm-owed.journal"  # in the disk tier's directory (a dot-file: never taken for a block)
# Next to the journal, written by a clean stop once the journal holds everything owed; taken (removed) at start.
CLEAN_NAME = ".kvbm-owed.clean"
JOURNAL_DELAY_S = 0.05  # an owed or paid block reaches the journal file within this (batched, one fsync)
RETRY_S = 2.0  # a failed flush is tried again after this (the owed writes' catch-up period)


class OwedJournal:
    """The journal file of :class:`OwedWrites`: lines noted (``+``/``-`` tier hash namespace) are written by a
    thread within ``delay_s``, one flush at a time; rewritten whole (``owed_lines``) when mostly paid or deleted."""

    def __init__(self, state: ManagerState, owed_lines: Callable[[], list[str]], total: Callable[[], int]) -> None:
        self.s = state
        self.path: Path | None = None
        self.read_only = False  # the directory cannot be written this run: replayed at open, never written
        self.delay_s = JOURNAL_DELAY_S
        self.retry_s = RETRY_S
        self._owed_lines = owed_lines
        self._total = total
        self._lines: list[str] = []  # journal lines not written yet
        self._in_file = 0  # lines in the journal file
        self._logged = -1e9
        self._flusher: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()  # one flush at a time: an append must not land in a file being replaced

    @property
    def pending(self) -> bool:
        return bool(self._lines)

    def note(self, op: str, tier: str, key: BlockKey) -> None:
        if self.path is not None and not self.read_only:
            self._lines.append(f"{op} {tier} {key.hash.hex()} {key.namespace}\n")
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        """Flush what was noted within ``delay_s`` (one batch, one fsync), until nothing is pending."""
        while self._lines:
            await asyncio.sleep(self.delay_s)
            try:
                await self.flush()
            except Exception as e:  # a full or failing disk: the lines stay pending, tried again
                self.failed(e)
                await asyncio.sleep(max(self.retry_s, self.delay_s))

    def failed(self, e: BaseException) -> None:
        """Log a failed journal write, once a minute at most: what is owed is still paid (the journal only lets a
        restart know it), and a start reconciles the disk against the bucket whatever the journal missed."""
        self.s.stats.errors["owed_journal"] = self.s.stats.errors.get("owed_journal", 0) + 1
        now = time.monotonic()
        if now - self._logged > 60:
            self._logged = now
            log.warning("owed-write journal %s not written (%d lines pending, retried): %s", self.path,
                        len(self._lines), e)

    async def flush(self) -> None:
        """Write the pending journal lines (in a thread); rewrite the file compactly when it is mostly paid.
        One flush at a time: a second waits for the first, then writes what is left. A flush cancelled while its
        thread writes still holds the lock until the write ends (then re-raises), so no two writes overlap."""
        async with self._flushing:
            if self.path is None or not self._lines:
                return
            lines, self._lines = self._lines, []
            # Deleted under us (an operator, a cleanup script): appending would leave only the new lines, and a
            # restart would forget everything owed before. Written whole again instead.
            gone = self._in_file > 0 and not await asyncio.to_thread(self.path.exists)
            if gone:
                log.warning("owed-write journal %s was deleted: written again with the %d blocks owed", self.path,
                            self._total())
            if gone or self._in_file + len(lines) > 2 * self._total() + 10_000:
                body = self._owed_lines()
                fn, after = _rewrite, len(body)
            else:
                body, fn, after = lines, _append, self._in_file + len(lines)
            work = asyncio.ensure_future(asyncio.to_thread(fn, self.path, body))
            cancelled = False
            while not work.done():
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:
                    cancelled = True  # the thread goes on writing: wait for it before anyone else may write
                except Exception:
                    break
            err = work.exception()
            if err is not None:
                self._lines[:0] = lines  # not written: the next flush writes them
            else:
                self._in_file = after
            if cancelled:
                raise asyncio.CancelledError
            if err is not None:
                raise err

    async def open(self, path: Path, *, read_only: bool = False) -> tuple[bool, dict[tuple[str, BlockKey], None]]:
        """Use ``path`` from now on: (whether the last run stopped cleanly with its journal in place, what the
        journal holds owed and unpaid). The clean mark is taken, a killed compaction's temporary files removed.
        ``read_only`` (a directory this run cannot write): the journal is only replayed, the mark only read (this
        run journals nothing, so a crash of it leaves the journal as true as it found it)."""
        self.path = path
        self.read_only = read_only
        mark = path.with_name(CLEAN_NAME)
        clean = await asyncio.to_thread(mark.exists if read_only else lambda: _take_clean_mark(mark))
        # A journal deleted while the daemon was stopped took what it owed along: then reconcile after all.
        clean = clean and await asyncio.to_thread(path.exists)
        stale = 0 if read_only else await asyncio.to_thread(_remove_stale_temps, path)
        if stale:
            log.info("removed %d temporary journal files a stopped run left (killed while compacting)", stale)
        try:
            owed = await asyncio.to_thread(_replay, path)
        except OSError as e:  # unreadable: the start-up reconcile owes what the disk holds and the bucket lacks
            self.failed(e)
            owed = {}
        return clean, owed

    async def rewrite(self) -> None:
        """Write the journal whole (what is owed now), as at start."""
        assert self.path is not None
        if self.read_only:
            return
        current = self._owed_lines()
        try:
            await asyncio.to_thread(_rewrite, self.path, current)
            self._in_file = len(current)
        except OSError as e:  # a full disk: the old journal stays (it replays to the same set), compacted later
            self.failed(e)
            self._in_file = 2 * len(current) + 10_000  # unknown: the next flush rewrites it

    async def mark_clean(self) -> None:
        if self.path is not None and not self.read_only and not self._lines:
            await asyncio.to_thread(_mark_clean, self.path.with_name(CLEAN_NAME))

    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._flusher] if self._flusher is not None else []


def _append(path: Path, lines: list[str]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # never another writer's
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _mark_clean(path: Path) -> None:
    """Say the journal next to ``path`` holds all this run owed; a mark that cannot be written only costs the next
    start a reconcile."""
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        f.write("the last run stopped cleanly\n")
        f.flush()
        os.fsync(f.fileno())


def _take_clean_mark(path: Path) -> bool:
    """Whether the last run stopped cleanly; the mark is removed (a crash of this run must not inherit it), and a
    mark that cannot be removed is not trusted."""
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _remove_stale_temps(path: Path) -> int:
    """Remove the temporary files of :func:`_rewrite` a killed run left next to ``path``; at start only, when the
    directory is this daemon's alone (the disk tier's lock), so none is another writer's. Returns how many."""
    n = 0
    for tmp in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):
        with contextlib.suppress(OSError):  # gone already, or not removable: tried again at the next start
            tmp.unlink()
            n += 1
    return n


def _replay(path: Path) -> dict[tuple[str, BlockKey], None]:
    """The blocks a journal holds owed and not paid, oldest first; a torn or foreign line is skipped."""
    owed: dict[tuple[str, BlockKey], None] = {}
    if not path.exists():
        return owed
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) != 4 or parts[0] not in "+-":
                continue
            op, tier, hexhash, namespace = parts
            try:
                key = BlockKey(namespace, bytes.fromhex(hexhash))
            except (ValueError, TypeError):
                continue
            if op == "+":
                owed[(tier, key)] = None
            else:
                owed.pop((tier, key), None)
    return owed
