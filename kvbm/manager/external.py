"""External stores: a worker copies a block into a G2 slot itself (through shared memory) between
:meth:`ExternalStores.prepare` and :meth:`ExternalStores.complete`; the slot stays reserved, and out of
eviction's reach, until then."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError
from kvbm.manager.leases import Lease
from kvbm.manager.room import Room
from kvbm.manager.state import ManagerState
from kvbm.tiers.pool import SlotPoolTier

# How long a store waits for a move of the same block into the tier (a prefetch from G3/G4) to end before leaving the
# block to it: a move that fails (the object gone, S3 down) would otherwise take the worker's bytes down with it.
MOVE_WAIT_S = 2.0


class ExternalStores:
    """Owns the prepared (not yet committed) stores: key -> (pool tier, payload bytes)."""

    def __init__(self, state: ManagerState, room: Room, cascade: Callable[[BlockKey], bool],
                 moving: Callable[[BlockKey, str], asyncio.Future[bool] | None] = lambda _k, _t: None) -> None:
        self.s = state
        self.room = room
        self._cascade = cascade
        self._moving = moving  # the move of a block into a tier under way (kvbm.manager.moves.Moves.in_flight)
        self._prepared: dict[BlockKey, tuple[str, int]] = {}

    def _pool(self, tier: str) -> SlotPoolTier:
        pool = self.s.by_name[tier]
        if not isinstance(pool, SlotPoolTier):
            raise KvbmError(f"{tier} is not a slot pool")
        return pool

    async def prepare(self, keys: Sequence[BlockKey], nbytes: int, tier: str,
                      admit: Callable[[int], None] | None = None) -> list[int | None]:
        """A reserved slot per key; None for keys already stored there or being stored right now (another
        worker's prepared store, a prefetch or a cascade copying it in, or an earlier copy in this batch).
        Room is made once for the whole batch (one reservation, one eviction pass), not per block. ``admit(n)``
        is told how many slots it is about to reserve, before it waits for room (it may raise: nothing is held)."""
        pool = self._pool(tier)
        fp = pool.footprint(nbytes)
        slots: list[int | None] = [None] * len(keys)
        todo, moves = self._todo(keys, tier, pool)
        if moves:  # a block being moved in (a prefetch) is the worker's to store if the move fails: wait (bounded)
            await asyncio.wait([asyncio.shield(f) for f in moves], timeout=MOVE_WAIT_S)
            todo, _ = self._todo(keys, tier, pool)
        if admit is not None:
            admit(len(todo))
        if not todo:
            return slots
        await self.room.reserve(pool, fp * len(todo))
        prepared, pending = self._prepared, pool.is_pending
        unused = len(todo)  # reservations not (yet) owned by a prepared slot
        try:
            await self.room.free_a_slot(pool, len(todo))
            # Re-checked after the awaits: a key may have arrived (or started arriving) while we made room.
            ready = [k for k, held in zip(todo, self.s.registry.holding(tier, list(todo)), strict=True)
                     if not held and not pending(k)]
            for key, slot in zip(ready, pool.allocate_many(ready, nbytes), strict=True):
                slots[todo[key]] = slot
                prepared[key] = (tier, nbytes)
            unused -= len(ready)
        except BaseException:
            self.complete([k for k, s in zip(keys, slots, strict=True) if s is not None], ok=False)
            raise
        finally:
            self.room.unreserve(pool, fp * unused)
        return slots

    def _todo(self, keys: Sequence[BlockKey], tier: str,
              pool: SlotPoolTier) -> tuple[dict[BlockKey, int], set[asyncio.Future[bool]]]:
        """One pass over ``keys``: the distinct ones to hand a slot (key -> its first index), and the moves into
        ``tier`` under way of those being stored there now."""
        todo: dict[BlockKey, int] = {}
        moves: set[asyncio.Future[bool]] = set()
        prepared, pending = self._prepared, pool.is_pending
        for i, (key, held) in enumerate(zip(keys, self.s.registry.holding(tier, keys), strict=True)):
            if held or key in todo or key in prepared:
                continue
            if not pending(key):
                todo[key] = i
            elif (f := self._moving(key, tier)) is not None:
                moves.add(f)
        return todo, moves

    def complete(self, keys: Sequence[BlockKey], ok: bool = True, *, cascade: bool = True,
                 partial: bool = False) -> int:
        """Commit (or abort) prepared slots; committed blocks write through below (``cascade``). ``partial``: they
        are partial blocks (kvbm.index.partials).

        Committing a key that is already there is a no-op (its slot stays; readers may be using it).
        """
        by_pool: dict[tuple[str, int], list[BlockKey]] = {}  # (tier, nbytes) -> its prepared keys, handled at once
        prepared = self._prepared
        for key in keys:
            ent = prepared.pop(key, None)
            if ent is not None:
                by_pool.setdefault(ent, []).append(key)
        done = 0
        for (tier, nbytes), batch in by_pool.items():
            pool = self._pool(tier)
            fp = pool.footprint(nbytes)
            if ok:
                committed = pool.commit_many(batch)
                self.s.registry.add_many(tier, committed, fp, partial=partial)
                done += len(committed)
                if cascade and self.s.below(tier):  # nothing below: a cascade would have nothing to do
                    for key in committed:
                        self._cascade(key)
            else:
                for key in batch:
                    pool.abort(key)
            self.room.unreserve(pool, fp * len(batch))
        return done

    def detach(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Lease]:
        """Abort prepared stores whose writer may still be copying: the keys are free to be stored
        again, but their slots stay referenced (returned as leases; the caller releases them when safe)."""
        leases: dict[BlockKey, Lease] = {}
        for key in keys:
            ent = self._prepared.pop(key, None)
            if ent is None:
                continue
            pool = self._pool(ent[0])
            slot = pool.detach(key)
            if slot is not None:
                leases[key] = Lease(key, ent[0], slot, ent[1], pinned=False)
            self.room.unreserve(pool, pool.footprint(ent[1]))
        return leases
