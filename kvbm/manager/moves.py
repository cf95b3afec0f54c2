"""Moving one block into a tier: from the nearest tier holding a good copy, with room made in the
destination, coalesced so concurrent moves of the same block into the same tier copy it once."""

from __future__ import annotations

import asyncio
import time

from kvbm.blocks import BlockKey
from kvbm.index.registry import Registry
from kvbm.manager import policy
from kvbm.manager.copiers import copy_block
from kvbm.manager.room import Room
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import Tier


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
            fut.set_result(ok)
            return ok
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # consumed here; waiters re-raise it
            raise
        finally:
            del self._inflight[slot]

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
