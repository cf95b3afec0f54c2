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
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from itertools import islice
from pathlib import Path

from kvbm.blocks import BlockKey
from kvbm.manager.owed_journal import OwedJournal
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import SharedTier

log = logging.getLogger(__name__)

CATCH_UP_EVERY_S = 2.0  # how often owed write-throughs check whether their tier takes writes again
RECONCILE_YIELD = 4096  # blocks compared per event-loop turn when reconciling a big disk
DEFAULT_MAX_OWED = 1_000_000
DRAIN_BATCH = 64


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

    def forget(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> int:
        """A purge of ``keys`` from ``tiers``: they are owed there no more (journaled as paid, so a restart does
        not write them back either); returns how many were owed."""
        n = 0
        for tier in tiers:
            owed = self._owed.get(tier)
            if not owed:
                continue
            for key in keys:
                if key in owed:
                    del owed[key]
                    self._again.discard((tier, key))
                    self._journal.note("-", tier, key)
                    n += 1
        return n

    def owed_to(self, keys: Iterable[BlockKey], tiers: Sequence[str]) -> set[BlockKey]:
        """Those of ``keys`` owed to any of ``tiers`` (their write there failed; the drain pays it later)."""
        owed = [o for t in tiers if (o := self._owed.get(t))]
        return {k for k in keys if any(k in o for o in owed)}

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
                if not any(self._owed.values()) and self._journal.pending:
                    # The paid lines, before this task ends: the flush yields, and a block owed meanwhile (a
                    # restart's reconcile) finds this task running and starts none, so the loop looks again.
                    try:
                        await asyncio.shield(self.flush())
                    except Exception as e:  # the lines stay pending: the next flush (or the next start) has them
                        self._journal.failed(e)
                elif not paid:
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

    async def resume(self, journal: Path, *, read_only: bool = False) -> int:
        """Use ``journal`` from now on and owe again what it holds unpaid (a restart after an outage); returns how
        many blocks that is. Blocks no tier holds any more are left out. ``read_only``: its directory cannot be
        written this run (see :meth:`OwedJournal.open`)."""
        self._journal.retry_s = self.every_s
        clean, owed = await self._journal.open(journal, read_only=read_only)
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
