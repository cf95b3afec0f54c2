"""External stores: a worker copies a block into a G2 slot itself (through shared memory) between
:meth:`ExternalStores.prepare` and :meth:`ExternalStores.complete`; the slot stays reserved, and out of
eviction's reach, until then."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError
from kvbm.room import Room
from kvbm.tiers.pool import SlotPoolTier

if TYPE_CHECKING:
    from kvbm.manager import BlockManager


class ExternalStores:
    """Owns the prepared (not yet committed) stores: key -> (pool tier, payload bytes)."""

    def __init__(self, manager: BlockManager, room: Room, cascade: Callable[[BlockKey], bool]) -> None:
        self.m = manager
        self.registry = manager.registry
        self.room = room
        self._cascade = cascade
        self._prepared: dict[BlockKey, tuple[str, int]] = {}

    def _pool(self, tier: str) -> SlotPoolTier:
        pool = self.m.by_name[tier]
        if not isinstance(pool, SlotPoolTier):
            raise KvbmError(f"{tier} is not a slot pool")
        return pool

    async def prepare(self, keys: Sequence[BlockKey], nbytes: int, tier: str) -> list[int | None]:
        """A reserved slot per key; None for keys already stored there or being stored right now (another
        worker's prepared store, a prefetch or a cascade copying it in)."""
        pool = self._pool(tier)
        slots: list[int | None] = []
        try:
            for key in keys:
                if self.registry.holds(tier, key) or key in self._prepared or pool.is_pending(key):
                    slots.append(None)
                    continue
                await self.room.reserve(pool, pool.footprint(nbytes))
                await self.room.free_a_slot(pool)
                if self.registry.holds(tier, key) or pool.is_pending(key):  # it arrived while we made room
                    self.room.unreserve(pool, pool.footprint(nbytes))
                    slots.append(None)
                    continue
                try:
                    slots.append(pool.allocate(key, nbytes))
                except BaseException:
                    self.room.unreserve(pool, pool.footprint(nbytes))
                    raise
                self._prepared[key] = (tier, nbytes)
        except BaseException:
            self.complete([k for k, s in zip(keys, slots, strict=False) if s is not None], ok=False)
            raise
        return slots

    def complete(self, keys: Sequence[BlockKey], ok: bool = True, *, cascade: bool = True) -> int:
        """Commit (or abort) prepared slots; committed blocks write through below (``cascade``).

        Committing a key that is already there is a no-op (its slot stays; readers may be using it).
        """
        done = 0
        for key in keys:
            ent = self._prepared.pop(key, None)
            if ent is None:
                continue
            tier, nbytes = ent
            pool = self._pool(tier)
            if ok and pool.commit(key):
                self.registry.add(tier, key, pool.footprint(nbytes))
                done += 1
                if cascade:
                    self._cascade(key)
            elif not ok:
                pool.abort(key)
            self.room.unreserve(pool, pool.footprint(nbytes))
        return done

    def detach(self, keys: Sequence[BlockKey]) -> dict[BlockKey, int]:
        """Abort prepared stores whose writer may still be copying: the keys are free to be stored
        again, but their slots stay referenced (returned; the caller unrefs them when safe)."""
        slots: dict[BlockKey, int] = {}
        for key in keys:
            ent = self._prepared.pop(key, None)
            if ent is None:
                continue
            pool = self._pool(ent[0])
            slot = pool.detach(key)
            if slot is not None:
                slots[key] = slot
            self.room.unreserve(pool, pool.footprint(ent[1]))
        return slots
