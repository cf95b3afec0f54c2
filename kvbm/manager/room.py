"""Room in a tier: reservations for writes in flight, and eviction of least-recently-used blocks to make it.

Eviction demotes: a block no lower tier holds is first written to the next tier that can take it. A
persistent tier never lets go of a block no lower tier really holds (it is *kept*, and the write that needed
the room fails with TierFullError); a memory tier drops it (counted in ``dropped``). "Really holds" for a shared
(S3) tier means seen there lately or confirmed by a HEAD now: another node may have purged it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvbm.blocks import BlockKey
from kvbm.errors import TierFullError
from kvbm.manager import policy
from kvbm.manager.state import ManagerState, Move, RealCopies
from kvbm.tiers.base import Tier
from kvbm.tiers.pool import SlotPoolTier


class Room:
    """Owns the per-tier reservations (``reserved`` bytes beyond what the registry counts) and eviction."""

    def __init__(self, state: ManagerState, move: Move, real_copies: RealCopies) -> None:
        self.s = state
        self._move = move
        self._real_copies = real_copies
        self._locks: dict[str, asyncio.Lock] = {}
        self._reserved: dict[str, int] = {}

    async def reserve(self, tier: Tier, footprint: int) -> None:
        """Reserve ``footprint`` bytes in ``tier``, evicting LRU blocks as needed.

        Raises TierFullError when pinned blocks, or blocks the tier must keep (no lower tier could take
        them), leave too little room.
        """
        lock = self._locks.setdefault(tier.name, asyncio.Lock())
        async with lock:
            need = footprint + self._reserved.get(tier.name, 0)
            skipped: list[BlockKey] = []  # pinned meanwhile: passed over (pinned here) while we look on
            try:
                while True:
                    try:
                        victims = self.s.victims(tier.name, need, tier.capacity_bytes)
                    except LookupError as e:
                        raise TierFullError(str(e)) from None
                    if not victims:
                        break
                    if policy.is_persistent(tier):  # the victims' copies below, re-checked in one batch
                        for t in self.s.below(tier.name):
                            await self._real_copies(t.name, victims)
                    for victim in victims:
                        gone = await self.evict(tier, victim)
                        if gone is None:
                            # The LRU block must stay and nothing below takes blocks now: the next
                            # victims would fare no better, so stop here instead of trying them all.
                            raise TierFullError(
                                f"{tier.name} is full: its least recently used block {victim} is held by no "
                                "lower tier and none can take it now")
                        if not gone:
                            skipped.append(victim)
                            self.s.registry.pin([victim], tier.name)
            finally:
                self.s.registry.unpin(skipped, tier.name)
            self._reserved[tier.name] = self._reserved.get(tier.name, 0) + footprint

    def unreserve(self, tier: Tier, footprint: int) -> None:
        self._reserved[tier.name] -= footprint

    @asynccontextmanager
    async def held(self, tier: Tier, footprint: int) -> AsyncIterator[None]:
        """Room for ``footprint`` bytes in ``tier`` for the duration of a write."""
        await self.reserve(tier, footprint)
        try:
            yield
        finally:
            self.unreserve(tier, footprint)

    async def free_a_slot(self, pool: SlotPoolTier, count: int = 1) -> None:
        """Room in the registry is not always a free slot: a removed block's slot stays taken while a
        reader still references it. Evict further LRU blocks until ``count`` slots are free (or none can go)."""
        for _ in range(pool.num_slots):
            if pool.free_slots() >= count:
                return
            used = self.s.registry.used(pool.name)
            try:
                victims = self.s.victims(pool.name, pool.capacity_bytes - used + pool.slot_bytes,
                                         pool.capacity_bytes)
            except LookupError:
                return  # everything left is pinned: allocate reports the pool full
            if not victims:
                return
            await self.evict(pool, victims[0])

    async def evict(self, tier: Tier, key: BlockKey) -> bool | None:
        """Evict ``key`` from ``tier``, demoting it first when no lower tier holds it.

        True: evicted. False: pinned meanwhile, left in place. None: kept because it is a persistent
        tier's only copy and no lower tier could take it (S3 down, disk full): it is never dropped.
        """
        s = self.s
        below = s.below(tier.name)
        if below and not await self._copy_below(tier, key, below):
            with s.registry.pinned([key]):
                for t in below:
                    if s.filtered(t, key):
                        continue
                    if not t.writable():  # would be shed: do not read the block for nothing
                        continue
                    try:
                        if await self._move(key, t.name):
                            s.stats.demotions += 1
                            break
                    except Exception as e:  # any failure: count it; the block stays until it is demoted
                        s.stats.demotion_failures += 1
                        s.failures.record("demotion", key, t.name, e)
            demoted = await self._copy_below(tier, key, below)
            filtered_only = all(s.filtered(t, key) for t in below)
            if not demoted and not filtered_only:
                if policy.is_persistent(tier):
                    s.stats.kept += 1
                    return None
                s.stats.dropped += 1
        if s.registry.is_pinned(key, tier.name):
            return False
        if s.registry.is_partial(key):
            s.stats.partial_evictions += 1
        s.registry.remove(tier.name, key)
        await tier.delete(key)
        s.stats.evictions += 1
        return True

    async def _copy_below(self, tier: Tier, key: BlockKey, below: list[Tier]) -> bool:
        """Whether a lower tier holds ``key``. For a persistent tier's eviction the copy must be known to exist
        (a shared tier's entry may be stale, :meth:`IndexSync.real_copies`); a memory tier trusts the registry."""
        if not policy.is_persistent(tier):
            return any(self.s.registry.holds(t.name, key) for t in below)
        for t in below:
            if self.s.registry.holds(t.name, key) and key in await self._real_copies(t.name, [key]):
                return True
        return False
