"""Step barriers: the ranks of one engine wait for each other at a step (``Barrier``).

An engine is named by the client (``engine_id``), so it is the credential's own: barriers are keyed by the
principal too, and another tenant naming the same engine_id gets its own engine, never a rank of this one."""

from __future__ import annotations

import asyncio

from kvbm import protocol as p


class Barriers:
    """Open barriers by (engine, step); one completes when ``world`` ranks arrived, or times out."""

    def __init__(self, default_timeout_s: float) -> None:
        self.default_timeout_s = default_timeout_s
        self._open: dict[tuple[str, str, str], tuple[set[int], asyncio.Future[None]]] = {}

    async def arrive(self, msg: p.Barrier, world: int, owner: str = "") -> p.BarrierReply:
        """Rank ``msg.rank`` of ``owner``'s (a principal's) engine ``msg.engine_id`` reached ``msg.step``."""
        key = (owner, msg.engine_id, str(msg.step))
        ent = self._open.get(key)
        if ent is None:
            ent = (set(), asyncio.get_running_loop().create_future())
            self._open[key] = ent
        ranks, fut = ent
        ranks.add(msg.rank)
        if len(ranks) >= world and not fut.done():
            fut.set_result(None)
            self._open.pop(key, None)
        try:
            await asyncio.wait_for(asyncio.shield(fut), msg.timeout_s or self.default_timeout_s)
        except TimeoutError:
            if self._open.get(key) is ent:
                self._open.pop(key, None)
            return p.BarrierReply(arrived=len(ranks), complete=False)
        return p.BarrierReply(arrived=len(ranks), complete=True)
