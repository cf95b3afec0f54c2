"""Read leases: a worker's hold on the slot pool slot of a block it onboarded (the load path's mirror of
:mod:`kvbm.manager.external`, the store path).

A lease is two holds: a registry pin, so eviction leaves the block in the pool while the worker reads it, and
a reference on the exact slot handed out, so an Evict and a re-store of the same key can never give that slot
to another block while the worker copies out of it. :meth:`ReadLeases.detach` drops the pin alone (the worker
may still be copying: the slot stays referenced), :meth:`ReadLeases.release` whatever is left. Callers (the
daemon's sessions) hold leases as opaque values: they read ``slot``/``nbytes`` for the reply, nothing more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError
from kvbm.manager.state import ManagerState
from kvbm.tiers.pool import SlotPoolTier


class Lease:
    """One block's slot held for a reader (or, detached from a store, for a writer that may still copy)."""

    __slots__ = ("held", "key", "nbytes", "pinned", "slot", "tier")

    def __init__(self, key: BlockKey, tier: str, slot: int, nbytes: int, *, pinned: bool) -> None:
        self.key = key
        self.tier = tier
        self.slot = slot
        self.nbytes = nbytes
        self.pinned = pinned  # the registry pin still held
        self.held = True  # the slot reference still held

    def __repr__(self) -> str:
        return f"Lease({self.key}, {self.tier} slot {self.slot}, pinned={self.pinned}, held={self.held})"


class ReadLeases:
    """Hands out and takes back leases; the only place the load path touches the registry's pins and the
    pool's slot references."""

    def __init__(self, state: ManagerState,
                 onboard: Callable[[Sequence[BlockKey], str, list[BaseException] | None], Awaitable[int]]) -> None:
        self.s = state
        self._onboard = onboard

    def _pool(self, tier: str) -> SlotPoolTier:
        pool = self.s.by_name[tier]
        if not isinstance(pool, SlotPoolTier):
            raise KvbmError(f"{tier} is not a slot pool")
        return pool

    async def reserve(self, keys: Sequence[BlockKey], tier: str,
                      stopped: list[BaseException] | None = None) -> list[Lease]:
        """Bring the leading held run of ``keys`` into pool ``tier`` and lease each of its blocks (the run may
        come up short: a block that failed on the way, or was removed before its slot was taken)."""
        pool, reg = self._pool(tier), self.s.registry
        reg.pin(keys)  # before the await, so nothing brought up is evicted before the reader has its slot
        try:
            n = await self._onboard(keys, tier, stopped)  # ``stopped``: what ended the run short, if anything
        except BaseException:
            reg.unpin(keys)
            raise
        leases: list[Lease] = []
        for key in keys[:n]:
            got = pool.acquire(key)
            if got is None:
                break
            leases.append(Lease(key, tier, got[0], got[1], pinned=True))
        reg.unpin(keys[len(leases):])
        return leases

    def detach(self, leases: Iterable[Lease]) -> None:
        """Drop the registry pins (the block may be evicted) but keep the slots referenced."""
        keys = []
        for lease in leases:
            if lease.pinned:
                lease.pinned = False
                keys.append(lease.key)
        if keys:
            self.s.registry.unpin(keys)

    def release(self, leases: Iterable[Lease]) -> int:
        """Drop what ``leases`` still hold (pin and slot reference); returns how many held a slot."""
        leases = list(leases)
        self.detach(leases)
        done = 0
        for lease in leases:
            if lease.held:
                lease.held = False
                self._pool(lease.tier).unref(lease.slot)
                done += 1
        return done
