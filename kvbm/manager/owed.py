"""Write-throughs owed after an outage: a tier that could not take a cascade (S3 down or shedding) is owed the
block, and the cascade is run again once the tier takes writes, so a block stored during an outage still ends up
on every tier below it.

* **Bounded**: at most ``max_blocks`` are owed in all (``s3.max_owed_blocks``). Beyond that a block is not owed
  (counted in ``owed_dropped``, logged): it stays where it is (durable on disk if it got there) but does not reach
  the lower tier by itself.
* **Journaled**: with a journal (the disk tier's ``.kvbm-owed.journal``; the blocks a restart can still write are
  the ones on disk) each block owed and each one paid is appended, by a thread, in batches, within
  ``journal_delay_s`` (a short debounce, not the retry delay: a crash loses at most that much); :meth:`resume` at
  the next start owes again what was never paid. One flush runs at a time; the file is rewritten compactly (via a
  temporary file of a unique name) once it is mostly paid lines.
* **Reconciled**: even an owed write the journal never got (a crash inside the debounce, a cascade still in flight,
  a deleted journal) is repaid: at start, once the bucket is listed, :meth:`reconcile` owes it every block the disk
  holds that the listing lacks. Not after a clean stop (its mark, ``.kvbm-owed.clean``, next to the journal): it
  drained every cascade and journaled what failed, so what the bucket lacks then it dropped on purpose (lifecycle
  expiry, another node's purge) and is not uploaded again.
* **Drained in batches**: once the tier takes writes, the oldest ``batch`` owed blocks are cascaded, awaited, then
  the next ones; nothing walks the whole set on the event loop, and the journal is written off it.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from itertools import islice
from pathlib import Path

from kvbm.blocks import BlockKey
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import SharedTier

log = logging.getLogger(__name__)

CATCH_UP_EVERY_S = 2.0  # how often owed write-throughs check whether their tier takes writes again
JOURNAL_NAME = ".kvbm-owed.journal"  # in the disk tier's directory (a dot-file: never taken for a block)
# Next to the journal, written by a clean stop once the journal holds everything owed; taken (removed) at start.
CLEAN_NAME = ".kvbm-owed.clean"
JOURNAL_DELAY_S = 0.05  # an owed or paid block reaches the journal file within this (batched, one fsync)
RECONCILE_YIELD = 4096  # blocks compared per event-loop turn when reconciling a big disk
DEFAULT_MAX_OWED = 1_000_000
DRAIN_BATCH = 64


class OwedJournal:
    """The journal file of :class:`OwedWrites`: lines noted (``+``/``-`` tier hash namespace) are written by a
    thread within ``delay_s``, one flush at a time; rewritten whole (``owed_lines``) when mostly paid or deleted."""

    def __init__(self, state: ManagerState, owed_lines: Callable[[], list[str]], total: Callable[[], int]) -> None:
        self.s = state
        self.path: Path | None = None
        self.delay_s = JOURNAL_DELAY_S
        self.retry_s = CATCH_UP_EVERY_S
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
        if self.path is not None:
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

    async def open(self, path: Path) -> tuple[bool, dict[tuple[str, BlockKey], None]]:
        """Use ``path`` from now on: (whether the last run stopped cleanly with its journal in place, what the
        journal holds owed and unpaid). The clean mark is taken, a killed compaction's temporary files removed."""
        self.path = path
        clean = await asyncio.to_thread(_take_clean_mark, path.with_name(CLEAN_NAME))
        # A journal deleted while the daemon was stopped took what it owed along: then reconcile after all.
        clean = clean and await asyncio.to_thread(path.exists)
        stale = await asyncio.to_thread(_remove_stale_temps, path)
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
        current = self._owed_lines()
        try:
            await asyncio.to_thread(_rewrite, self.path, current)
            self._in_file = len(current)
        except OSError as e:  # a full disk: the old journal stays (it replays to the same set), compacted later
            self.failed(e)
            self._in_file = 2 * len(current) + 10_000  # unknown: the next flush rewrites it

    async def mark_clean(self) -> None:
        if self.path is not None and not self._lines:
            await asyncio.to_thread(_mark_clean, self.path.with_name(CLEAN_NAME))

    def tasks(self) -> list[asyncio.Task[None]]:
        return [self._flusher] if self._flusher is not None else []


class OwedWrites:
    """Tier -> keys owed (oldest first); a task drains them while any are owed. ``cascade`` writes one block
    through to every lower tier lacking it (:meth:`WriteThrough.cascade`). The journal: :class:`OwedJournal`."""

    def __init__(self, state: ManagerState, cascade: Callable[[BlockKey], Awaitable[bool]], *,
                 max_blocks: int = DEFAULT_MAX_OWED, batch: int = DRAIN_BATCH) -> None:
        self.s = state
        self.cascade = cascade
        self.every_s = CATCH_UP_EVERY_S
        self.max_blocks = max_blocks
        self.batch = max(1, batch)
        self._owed: dict[str, dict[BlockKey, None]] = {}
        self._again: set[tuple[str, BlockKey]] = set()  # owed again while being paid: the tier failed once more
        self._journal = OwedJournal(state, self._lines, self.total)
        self._dropped_logged = 0.0
        self._clean_start = False  # the last run stopped cleanly: its journal holds all it owed
        self._settled = False  # nothing unjournaled is left from a crash: a clean start, or a whole reconcile done
        self._task: asyncio.Task[None] | None = None

    @property
    def journal(self) -> Path | None:
        return self._journal.path

    @property
    def journal_delay_s(self) -> float:
        return self._journal.delay_s

    @journal_delay_s.setter
    def journal_delay_s(self, delay_s: float) -> None:
        self._journal.delay_s = delay_s

    @property
    def settled(self) -> bool:
        """Whether nothing unjournaled is left from a crash (a clean start, or the disk reconciled whole)."""
        return self._settled

    def settle(self) -> None:
        """Say the disk was reconciled against the bucket whole (namespace by namespace, a lazy start)."""
        self._settled = True

    def _lines(self) -> list[str]:
        return [f"+ {t} {k.hash.hex()} {k.namespace}\n" for t, keys in self._owed.items() for k in keys]

    async def flush(self) -> None:
        """Write the pending journal lines (see :meth:`OwedJournal.flush`)."""
        await self._journal.flush()

    # -- owing ------------------------------------------------------------------------------------
    def owe(self, tier: str, key: BlockKey) -> None:
        owed = self._owed.setdefault(tier, {})
        if key in owed:
            self._again.add((tier, key))
            return
        if self.total() >= self.max_blocks:
            self.s.stats.owed_dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged > 60:
                self._dropped_logged = now
                log.warning("%d write-throughs already owed (s3.max_owed_blocks): %s will not reach %s by itself",
                            self.total(), key, tier)
            return
        owed[key] = None
        self._journal.note("+", tier, key)
        self._wake(delay=True)

    def _wake(self, *, delay: bool = False) -> None:
        """Start draining unless already draining. ``delay``: a write just failed there, so the first try waits
        ``every_s`` (retrying at once would only meet the same outage, or the breaker opening on it)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(self.every_s if delay else 0.0))

    def total(self) -> int:
        return sum(len(keys) for keys in self._owed.values())

    def counts(self) -> dict[str, int]:
        """Blocks per tier whose write-through is waiting for that tier to take writes again."""
        return {t: len(keys) for t, keys in self._owed.items() if keys}

    # -- paying -----------------------------------------------------------------------------------
    async def _loop(self, delay: float = 0.0) -> None:
        """While write-throughs are owed: drain those whose tier is writable, batch by batch; else wait."""
        try:
            await asyncio.sleep(delay)
            while any(self._owed.values()):
                paid = 0
                try:
                    await self.flush()
                except Exception as e:  # a full or failing disk: the lines stay pending, the blocks still owed
                    self._journal.failed(e)
                for name in [n for n, keys in self._owed.items() if keys]:
                    if self.s.by_name[name].writable():
                        paid += await self.drain_batch(name)
                if not paid:
                    await asyncio.sleep(self.every_s)
        finally:
            if self._journal.pending:
                with contextlib.suppress(Exception):  # logged by the flusher; the next start reconciles
                    await asyncio.shield(self.flush())

    async def drain_batch(self, tier: str) -> int:
        """Cascade the oldest ``batch`` blocks owed to ``tier``; returns how many are paid."""
        owed = self._owed.get(tier, {})
        keys = list(islice(owed, self.batch))
        if not keys:
            return 0
        results = await asyncio.gather(*(self._pay(tier, k) for k in keys), return_exceptions=True)
        return sum(r is True for r in results)

    async def _pay(self, tier: str, key: BlockKey) -> bool:
        owed = self._owed[tier]
        held = self.s.registry.holds(tier, key)
        if self.s.registry.where(key) and (not held or self._unconfirmed(tier, key)):
            self._again.discard((tier, key))
            self.s.stats.catch_up_writes += 1
            await self.cascade(key)
            if (tier, key) in self._again and (not self.s.registry.holds(tier, key) or self._unconfirmed(tier, key)):
                self._again.discard((tier, key))
                return False  # the tier failed again (an outage, or its re-check HEAD failed): still owed
        # Written now, or by another path meanwhile, or no copy left above to write from: owed no more.
        paid = self.s.registry.holds(tier, key)
        owed.pop(key, None)
        self._journal.note("-", tier, key)
        if paid:
            self.s.stats.owed_paid += 1
        return paid

    def _unconfirmed(self, tier: str, key: BlockKey) -> bool:
        """A shared tier's entry not seen lately (owed because its re-check failed): the cascade HEADs it again,
        and writes it if the bucket lacks it."""
        t = self.s.by_name[tier]
        return isinstance(t, SharedTier) and not t.seen_within(key)

    async def resume(self, journal: Path) -> int:
        """Use ``journal`` from now on and owe again what it holds unpaid (a restart after an outage); returns how
        many blocks that is. Blocks no tier holds any more are left out."""
        self._journal.retry_s = self.every_s
        clean, owed = await self._journal.open(journal)
        self._clean_start = self._settled = clean
        n = 0
        for (tier, key) in owed:
            if tier in self.s.by_name and self.s.registry.where(key) and not self.s.registry.holds(tier, key):
                if self.total() >= self.max_blocks:
                    self.s.stats.owed_dropped += 1
                    continue
                self._owed.setdefault(tier, {})[key] = None
                n += 1
        await self._journal.rewrite()
        self.s.stats.owed_resumed += n
        if n:
            log.info("%d write-throughs owed before the restart resumed", n)
            self._wake()
        return n

    async def reconcile(self, src: str, dst: str, namespace: str | None = None) -> int:
        """Owe ``dst`` every block (of ``namespace``, default all) tier ``src`` holds and ``dst`` lacks, as far as
        the index knows just after ``dst`` was listed; returns how many were newly owed. What a lost journal
        entry (or a crash mid-cascade) left on disk only is repaid this way."""
        if self._clean_start:
            # A clean stop drained every cascade and journaled what failed: a block the disk holds and the bucket
            # lacks reached it and was dropped there on purpose (lifecycle expiry, another node's purge).
            log.info("the last run stopped cleanly: %s not reconciled against %s (its journal holds what is owed)",
                     namespace or "the bucket", src)
            return 0
        reg = self.s.registry
        owed = self._owed.setdefault(dst, {})
        n = 0
        for i, key in enumerate(reg.iter_keys(src)):
            if i and i % RECONCILE_YIELD == 0:
                await asyncio.sleep(0)  # a big disk: let requests in between
            if (namespace is not None and key.namespace != namespace) or key in owed or reg.holds(dst, key):
                continue
            if self.total() >= self.max_blocks:
                self.s.stats.owed_dropped += 1
                continue
            owed[key] = None
            self._journal.note("+", dst, key)
            n += 1
        if namespace is None:
            self._settled = True  # (what a lazy start reconciles namespace by namespace never settles a crash)
        if n:
            self.s.stats.owed_reconciled += n
            log.info("%d blocks on %s missing from %s after a restart: owed to it", n, src, dst)
            self._wake()
        return n

    async def close(self) -> None:
        """Stop draining; what is still owed stays in the journal for the next start."""
        for task in (self._task, *self._journal.tasks()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # the cascades logged their failures
                    await task
        try:
            await self.flush()
        except Exception as e:  # the tiers must still close; the next start reconciles what was not journaled
            self._journal.failed(e)
            return
        if self._settled:
            await self._journal.mark_clean()

    def cancel(self) -> None:
        for task in (self._task, *self._journal.tasks()):
            if task is not None:
                task.cancel()


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
