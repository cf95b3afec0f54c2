"""Superseding partial blocks: once the full block that begins with a partial block's tokens is stored, the partial
block's copies leave every tier (G2, G3 and G4), in the background.

Keys are one-way chained hashes, so the manager cannot find a full block's partial blocks itself: the worker that
stores a full block names them (``CommitStore.covers``: for the vLLM connector, the hashes of the full block's
leading vLLM blocks, the keys any partial block of those tokens has). Only blocks the registry knows as partial are
dropped, and only once the covering full block is held, so a wrong or stale name costs nothing.

G4 too: the bucket has no LRU, so a superseded partial object would stay there (listed by every node) until a purge;
its full block is written through instead. A write-through of the partial block still queued or owed finds no copy
to read and writes nothing. A drop first waits out the partial block's copies under way (its own cascade), then
takes it out of the registry in one step (no move can start from a tier it is leaving), then deletes the bytes; a
partial block a worker holds pinned (it is reading it) stays, an ordinary block from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvbm.blocks import BlockKey
from kvbm.manager.state import ManagerState

log = logging.getLogger(__name__)

MOVE_WAIT_S = 2.0  # the longest a drop waits for one round of the partial block's copies under way
MOVE_ROUNDS = 4  # a cascade starts its next tier's copy as one ends: this many rounds, then the drop goes on


class Supersedes:
    """The partial blocks being dropped for the full blocks that cover them (``pending``: the drops under way)."""

    def __init__(self, state: ManagerState, moving: Callable[[BlockKey, str], asyncio.Future[bool] | None]) -> None:
        self.s = state
        self._moving = moving  # kvbm.manager.moves.Moves.in_flight
        self.pending: set[asyncio.Task[None]] = set()

    def schedule(self, fulls: Sequence[BlockKey], covers: Sequence[Sequence[BlockKey]]) -> int:
        """Drop the partial blocks ``covers[i]`` of each full block ``fulls[i]`` the registry holds; how many
        drops were started."""
        reg = self.s.registry
        drop = list(dict.fromkeys(p for full, ps in zip(fulls, covers, strict=True) if ps and reg.where(full)
                                  for p in ps if p != full and reg.is_partial(p)))
        for key in drop:
            task = asyncio.get_running_loop().create_task(self._drop(key))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        return len(drop)

    async def drain(self) -> None:
        while self.pending:
            await asyncio.gather(*list(self.pending), return_exceptions=True)

    async def _drop(self, key: BlockKey) -> None:
        s = self.s
        try:
            for _ in range(MOVE_ROUNDS):  # a copy landing after the drop would bring the block back
                moves = [f for t in s.tiers if (f := self._moving(key, t.name)) is not None]
                if not moves:
                    break
                await asyncio.wait([asyncio.shield(f) for f in moves], timeout=MOVE_WAIT_S)
            reg = s.registry
            if not reg.is_partial(key):
                return  # gone meanwhile (evicted, deleted)
            where = reg.where(key)
            if any(reg.is_pinned(key, name) for name in where):  # a worker reading it (a lease pins it in G2)
                s.stats.partials_kept += 1
                return
            for name in where:  # all at once, no await between: nothing copies from a tier it is leaving
                reg.remove(name, key)
            s.stats.partials_superseded += 1
            for name in where:
                tier = s.by_name[name]
                try:
                    await tier.delete_blocks([key])
                except Exception as e:  # still there (S3 down): indexed again, it is an ordinary block's bytes
                    s.failures.record("supersede", key, name, e)
                    n = tier.nbytes(key)
                    if n is not None:
                        reg.add(name, key, tier.footprint(n))
        except Exception as e:  # background work never takes the daemon down
            log.warning("superseding partial block %s failed: %s", key, e)
