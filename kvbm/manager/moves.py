"""Moving one block into a tier: from the nearest tier holding a good copy, with room made in the
destination, coalesced so concurrent moves of the same block into the same tier copy it once. A move that a purge
covered while it was under way (:meth:`Moves.cover`) deletes what it wrote once it lands, so the purge is not undone
by a write-through (an S3 PUT) that was already in flight when it was answered."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

from kvbm.blocks import BlockKey
from kvbm.index.registry import Registry
from kvbm.manager import policy
from kvbm.manager.copiers import copy_block
from kvbm.manager.deletes import delete_copies
from kvbm.manager.room import Room
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import Tier

log = logging.getLogger(__name__)


def forget_if_gone(registry: Registry, tier: Tier, key: BlockKey) -> None:
    """After a failed read: forget ``tier``'s copy only if the tier dropped it (corrupt or vanished);
    a read that failed because the tier is unreachable (S3 down) leaves a copy that is still there."""
    if tier.nbytes(key) is None:
        registry.remove(tier.name, key)


class Moves:
    """Owns the moves in flight (one future per (block, destination tier))."""

    def __init__(self, state: ManagerState, room: Room) -> None:
        self.s = state
        self.room = room
        self._inflight: dict[tuple[BlockKey, str], asyncio.Future[bool]] = {}
        self._purged: set[tuple[BlockKey, str]] = set()  # moves in flight a purge covered: they undo their copy

    def moving(self, tiers: Sequence[str], namespace: str) -> list[BlockKey]:
        """The blocks of ``namespace`` being moved into any of ``tiers`` now (a namespace-wide purge covers them)."""
        return [k for (k, t) in self._inflight if t in tiers and k.namespace == namespace]

    def cover(self, keys: Iterable[BlockKey], tiers: Sequence[str]) -> list[asyncio.Future[bool]]:
        """A purge of ``keys`` from ``tiers``: mark the moves of them into those tiers under way now, so each deletes
        its copy once it lands (and reports it did not arrive); returns their futures (done once the copy is
        gone again, or the move failed), for the purge to wait on, bounded."""
        futs = []
        for key in keys:
            for name in tiers:
                fut = self._inflight.get((key, name))
                if fut is not None:
                    self._purged.add((key, name))
                    futs.append(fut)
        return futs

    def in_flight(self, key: BlockKey, dst_name: str) -> asyncio.Future[bool] | None:
        """The move of ``key`` into ``dst_name`` under way (its result: whether it arrived), if there is one."""
        return self._inflight.get((key, dst_name))

    async def move(self, key: BlockKey, dst_name: str) -> bool:
        """Copy ``key`` from the fastest tier holding it into ``dst_name`` (coalesced per key/tier)."""
        if self.s.registry.holds(dst_name, key):
            return True
        slot = (key, dst_name)
        fut = self._inflight.get(slot)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[slot] = fut
        try:
            ok = await self._do_move(key, self.s.by_name[dst_name])
            if slot in self._purged:
                ok = await self._undo(key, dst_name, ok)
            fut.set_result(ok)
            return ok
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # consumed here; waiters re-raise it
            raise
        finally:
            del self._inflight[slot]
            self._purged.discard(slot)

    async def _undo(self, key: BlockKey, dst_name: str, arrived: bool) -> bool:
        """A purge covered this move while it was under way: delete the copy it wrote (only what the tier really
        deleted leaves the index, so a delete that fails leaves it indexed for the next purge); never arrived."""
        if arrived and self.s.registry.holds(dst_name, key):
            try:
                await delete_copies(self.s, [key], [dst_name])
            except Exception as e:  # S3 down now: still indexed there, so the next purge deletes it
                log.warning("%s was purged while its copy into %s was under way; deleting that copy failed: %s",
                            key, dst_name, e)
        return False

    async def _do_move(self, key: BlockKey, dst: Tier) -> bool:
        s = self.s
        if s.registry.holds(dst.name, key):
            return True
        for src_name in policy.copy_sources(s.tiers, s.registry, key, dst.name):
            src = s.by_name[src_name]
            n = src.nbytes(key)
            if n is None:
                s.registry.remove(src_name, key)  # the tier lost it (e.g. deleted behind our back)
                continue
            fp = dst.footprint(n)
            with s.registry.pinned([key], src_name):
                async with self.room.held(dst, fp):
                    t0 = time.perf_counter()
                    ok = await copy_block(key, src, dst, n, s.mover)
                    if ok:
                        s.observe_copy(src_name, dst.name, time.perf_counter() - t0)
                        s.registry.add(dst.name, key, fp)
            if ok:
                return True
            forget_if_gone(s.registry, src, key)
        return False
