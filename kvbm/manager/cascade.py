"""Write-through: a block stored into a tier is copied, in the background, to every lower tier.

Cascades run at most ``max_concurrent`` at once (a burst queues here instead of being shed by a lower
tier's own write limit) and at most ``max_pending`` are queued (more are shed, counted). A cascade that
raises anything is counted and logged (:class:`~kvbm.manager.failures.FailureLog`) and leaves the block where it
was; one a tier could not take for an outage is owed to it (:class:`~kvbm.manager.owed.OwedWrites`), and so is one
whose stale shared-tier entry could not be re-checked (its HEAD failed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence

from kvbm.blocks import BlockKey
from kvbm.errors import TierUnavailableError
from kvbm.manager import policy
from kvbm.manager.owed import DEFAULT_MAX_OWED, OwedWrites
from kvbm.manager.state import ManagerState, Move, RealCopies

SHED_KEPT = 65536  # shed blocks remembered for a purge's catch-up (a key and a dict slot each: a few MiB at most)


class WriteThrough:
    """Owns the background cascades (``pending``) and the writes owed after an outage (``owed``)."""

    def __init__(self, state: ManagerState, move: Move, real_copies: RealCopies, max_pending: int,
                 max_concurrent: int, max_owed: int = DEFAULT_MAX_OWED) -> None:
        self.s = state
        self._move = move
        self._real_copies = real_copies
        self.max_pending = max_pending
        self.pending: set[asyncio.Task[bool]] = set()
        # Every cascade of each block queued or under way: background ones (from their scheduling), a durable
        # store's and the owed drain's direct ones (from their call). A purge of the tiers above waits for them.
        self._of_key: dict[BlockKey, set[asyncio.Future[bool]]] = {}
        # Blocks whose background cascade was shed (too many queued), latest last, at most SHED_KEPT: a purge of
        # the tiers above starts them again first (their only copy would go with it otherwise).
        self._shed: dict[BlockKey, None] = {}
        self._slots = asyncio.Semaphore(max(1, max_concurrent))
        self.owed = OwedWrites(state, self.cascade, max_blocks=max_owed)

    def schedule(self, key: BlockKey) -> bool:
        """Start a background cascade of ``key``; False (shed, counted) when too many are queued."""
        if len(self.pending) >= self.max_pending:
            self.s.stats.shed_offloads += 1
            self._shed.pop(key, None)
            self._shed[key] = None
            if len(self._shed) > SHED_KEPT:
                del self._shed[next(iter(self._shed))]
            return False
        self._start(key)
        return True

    def _start(self, key: BlockKey) -> None:
        task = asyncio.get_running_loop().create_task(self.cascade(key))
        self.pending.add(task)
        self._track(key, task)
        task.add_done_callback(self.pending.discard)

    def catch_up(self, keys: Iterable[BlockKey]) -> int:
        """Start now the background cascades shed earlier of those of ``keys`` (past ``max_pending``: a purge of
        the tiers above lets them land first); how many started."""
        shed = [k for k in keys if k in self._shed]
        for k in shed:
            self._start(k)
        return len(shed)

    def _track(self, key: BlockKey, fut: asyncio.Future[bool]) -> None:
        self._of_key.setdefault(key, set()).add(fut)
        fut.add_done_callback(lambda f: self._untrack(key, f))

    def _untrack(self, key: BlockKey, fut: asyncio.Future[bool]) -> None:
        futs = self._of_key.get(key)
        if futs is not None:
            futs.discard(fut)
            if not futs:
                del self._of_key[key]

    def of(self, keys: Iterable[BlockKey]) -> dict[BlockKey, set[asyncio.Future[bool]]]:
        """The cascades of ``keys`` queued or under way now (a purge of the tiers above lets them land)."""
        return {k: set(f) for k in keys if (f := self._of_key.get(k))}

    async def drain(self) -> None:
        """Wait until every background cascade has finished."""
        while self.pending:
            await asyncio.gather(*list(self.pending), return_exceptions=True)

    def tracked(self, key: BlockKey) -> asyncio.Future[bool]:
        """A future a purge sees as ``key``'s cascade from now on: hand it to :meth:`cascade`, which resolves it
        (a caller that awaits something before cascading makes it first, so no purge slips in between)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._track(key, done)
        return done

    async def durably(self, keys: Sequence[BlockKey], first: Callable[[], Awaitable[None]]) -> int:
        """Cascade ``keys`` now and wait for them; how many end on a persistent tier. ``first`` runs before, once
        the blocks are seen by a purge as being written down (so none slips in while it awaits)."""
        dones = [self.tracked(k) for k in keys]
        try:
            await first()
            return sum(await asyncio.gather(*(self.cascade(k, d) for k, d in zip(keys, dones, strict=True))))
        finally:
            for d in dones:
                if not d.done():
                    d.set_result(False)

    async def cascade(self, key: BlockKey, done: asyncio.Future[bool] | None = None) -> bool:
        """Copy ``key`` to every lower tier that lacks it; True if it ends on a persistent tier."""
        self._shed.pop(key, None)  # written down now (or tried): no longer owed a catch-up
        if done is None:
            done = self.tracked(key)  # seen by a purge from its call on, while it waits for a slot too
        try:
            async with self._slots:
                ok = await self._cascade_now(key)
        finally:
            if not done.done():
                done.set_result(False)
        return ok

    async def _cascade_now(self, key: BlockKey) -> bool:
        s = self.s
        where = s.registry.where(key)
        if not where:
            return False
        durable = False
        for tier in s.below(where[0]):
            if tier.read_only is not None and not s.registry.holds(tier.name, key):
                continue  # takes no writes this run: nothing is owed to it either
            if s.registry.holds(tier.name, key):
                # Counted only if it is known to be there (a shared tier's entry may be stale: kvbm.manager.knowledge).
                if key in await self._real_copies(tier.name, [key]):
                    durable = durable or policy.is_persistent(tier)
                    continue
                if s.registry.holds(tier.name, key):
                    # The bucket did not answer whether it is there (an S3 blip): not counted, and owed, so it is
                    # checked again (and written if it is missing) once the tier takes writes.
                    s.stats.cascade_failures += 1
                    self.owed.owe(tier.name, key)
                    continue
            if s.filtered(tier, key):
                s.stats.filtered += 1
                continue
            try:
                ok = await self._move(key, tier.name)
            except Exception as e:  # any failure: count it, keep the block where it is, go on below
                s.failures.record("cascade", key, tier.name, e)
                ok = False
                if isinstance(e, TierUnavailableError):  # an outage or shed write: owed, retried later
                    self.owed.owe(tier.name, key)
            if ok:
                s.stats.cascade_writes += 1
                durable = durable or policy.is_persistent(tier)
            else:
                s.stats.cascade_failures += 1
        return durable
