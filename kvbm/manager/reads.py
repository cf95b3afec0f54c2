"""Reads: an onboard (the longest leading run of blocks held anywhere, brought up to a target tier, staging through
G2 from disk or S3) and a single block's bytes; the manager's, given its state, its moves and its write-through."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.manager import policy
from kvbm.manager.cascade import WriteThrough
from kvbm.manager.moves import Moves, forget_if_gone
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import Tier
from kvbm.tiers.names import TierName

log = logging.getLogger("kvbm.manager.core")  # the manager's log, as before the reads were their own module


class Reads:
    """Onboards and reads of blocks the registry knows."""

    def __init__(self, state: ManagerState, moves: Moves, write_through: WriteThrough) -> None:
        self.state, self.moves, self.write_through = state, moves, write_through

    async def onboard(self, keys: Sequence[BlockKey], to: str | None = None, *, hit: bool = True,
                      stopped: list[BaseException] | None = None) -> int:
        """See :meth:`kvbm.manager.BlockManager.onboard`."""
        st = self.state
        target = st.by_name[to] if to else st.tiers[0]
        t0 = time.perf_counter()
        found = st.registry.match_prefix(keys)
        run = list(keys[: len(found)])
        if hit:
            st.registry.record_hit(run)
        staging = st.by_name.get(TierName.G2) if target.kind == "device" else None
        done = 0
        if all(st.registry.holding(target.name, run)):
            # All in place (a prefix hit in G2): no task per block, so the reply leaves this loop turn, not two
            # turns later behind whatever else the daemon runs meanwhile (issue 37).
            for k in run:
                st.registry.touch(target.name, k)
            done = len(run)
        else:
            with st.registry.pinned(run):
                results = await asyncio.gather(
                    *(self._bring_up(k, target, staging) for k in run), return_exceptions=True
                )
            for r in results:
                if r is not True:
                    if isinstance(r, BaseException):
                        log.warning("onboard stopped: %s", r)
                        if stopped is not None:
                            stopped.append(r)
                    break
                done += 1
        st.stats.onboards += 1
        st.stats.onboard_blocks += done
        st.stats.onboard_seconds += time.perf_counter() - t0
        return done

    async def _bring_up(self, key: BlockKey, target: Tier, staging: Tier | None) -> bool:
        reg = self.state.registry
        if reg.holds(target.name, key):
            reg.touch(target.name, key)
            return True
        where = reg.where(key)
        stage = staging.name if staging is not None and policy.needs_staging(where) else ""
        if stage and stage not in where and not await self.moves.move(key, stage):
            return False
        if not await self.moves.move(key, target.name):
            return False
        pl = self.state.placement
        if pl is not None and pl.promotes(self.state.tiers, where, target.name):
            self.write_through.schedule(key)  # a G4 hit is written to G3 too: it returned, it is worth keeping there
        return True

    async def read(self, key: BlockKey) -> bytes | None:
        """The block's bytes from the fastest tier that has a good copy."""
        reg, by_name = self.state.registry, self.state.by_name
        for name in reg.where(key):
            data = await by_name[name].get(key)
            if data is not None:
                reg.record_hit([key])
                return data
            forget_if_gone(reg, by_name[name], key)
        return None
