"""Prefetch: a lookup that hits disk or S3 is usually followed by an Onboard, so the blocks start up to G2
at once, in the background, and the Onboard finds them there (or joins the copy in flight).

A prefetch pins its G2 slots until its slowest block arrives, so it is bounded by the budgets of the session
whose lookup started it: together, the prefetches in flight for a tenant (or a session without one) bring up no
more than its slot budgets have left (:meth:`Sessions.room`). They are not charged to the session itself: the
Onboard that follows pins the same blocks, and must not be refused for its own prefetch. A tenant's prefetches
thus never take the G2 slots of another tenant's budget."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.daemon.sessions import Sessions, WorkerSession
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Spawn
from kvbm.manager.core import BlockManager
from kvbm.tiers.names import FAST, TierName

log = logging.getLogger("kvbm.daemon")


class Prefetcher:
    """At most ``max_prefetch`` prefetches at once; more are skipped (counted), never queued."""

    def __init__(self, manager: BlockManager, stats: DaemonStats, max_prefetch: int, spawn: Spawn,
                 sessions: Sessions) -> None:
        self.manager = manager
        self.stats = stats
        self.max_prefetch = max_prefetch
        self.sessions = sessions
        self._spawn = spawn
        self._running = 0
        self._inflight: dict[str, int] = {}  # slots of the prefetches in flight, per tenant (or session)

    def after_lookup(self, keys: Sequence[BlockKey], tiers: Sequence[str], w: WorkerSession) -> None:
        """Prefetch, for ``w``, the matched run if part of it is on a slow tier."""
        if any(t not in FAST for t in tiers):
            self._start(list(keys[: min(len(tiers), self._room())]), w)

    def _room(self) -> int:
        """At most half of G2's slots: an onboard pins its whole run, so a prefetch of more than G2 holds would
        pin G2 full and fail itself and every Onboard meanwhile (a lookup of a store larger than G2)."""
        g2 = self.manager.by_name.get(TierName.G2)
        slots = getattr(g2, "num_slots", 0)
        return max(1, slots // 2) if slots else 1 << 30

    def after_probe(self, keys: Sequence[BlockKey], w: WorkerSession) -> None:
        """A probe finished after its lookup was answered: prefetch what the index holds now."""
        if self.sessions.alive(w):
            self.after_lookup(keys, self.manager.registry.match_prefix(keys), w)

    def _start(self, keys: list[BlockKey], w: WorkerSession) -> None:
        whose = w.principal if w.principal_slots else w.token
        left = self.sessions.room(w, 1 << 30)  # what its budgets have left (all of it when it has none)
        n = min(len(keys), left - self._inflight.get(whose, 0))
        if self._running >= self.max_prefetch or n <= 0:
            self.stats.prefetch_skipped += 1
            return
        keys = keys[:n]
        self._running += 1
        self._inflight[whose] = self._inflight.get(whose, 0) + n

        async def run() -> None:
            try:
                self.stats.prefetch_blocks += await self.manager.onboard(keys, to=TierName.G2, hit=False)
            except Exception as e:  # a prefetch is a hint; the Onboard that follows reports real errors
                log.debug("prefetch failed: %s", e)
            finally:
                self._running -= 1
                if left := self._inflight[whose] - n:
                    self._inflight[whose] = left
                else:
                    del self._inflight[whose]

        self.stats.prefetches += 1
        self._spawn(run())
