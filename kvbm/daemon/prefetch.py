"""Prefetch: a lookup that hits disk or S3 is usually followed by an Onboard, so the blocks start up to G2
at once, in the background, and the Onboard finds them there (or joins the copy in flight)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Spawn
from kvbm.manager.core import BlockManager
from kvbm.tiers.names import FAST, TierName

log = logging.getLogger("kvbm.daemon")


class Prefetcher:
    """At most ``max_prefetch`` prefetches at once; more are skipped (counted), never queued."""

    def __init__(self, manager: BlockManager, stats: DaemonStats, max_prefetch: int, spawn: Spawn) -> None:
        self.manager = manager
        self.stats = stats
        self.max_prefetch = max_prefetch
        self._spawn = spawn
        self._running = 0

    def after_lookup(self, keys: Sequence[BlockKey], tiers: Sequence[str]) -> None:
        """Prefetch the matched run if part of it is on a slow tier."""
        if any(t not in FAST for t in tiers):
            self._start(list(keys[: min(len(tiers), self._room())]))

    def _room(self) -> int:
        """At most half of G2's slots: an onboard pins its whole run, so a prefetch of more than G2 holds would
        pin G2 full and fail itself and every Onboard meanwhile (a lookup of a store larger than G2)."""
        g2 = self.manager.by_name.get(TierName.G2)
        slots = getattr(g2, "num_slots", 0)
        return max(1, slots // 2) if slots else 1 << 30

    def after_probe(self, keys: Sequence[BlockKey]) -> None:
        """A probe finished after its lookup was answered: prefetch what the index holds now."""
        self.after_lookup(keys, self.manager.registry.match_prefix(keys))

    def _start(self, keys: list[BlockKey]) -> None:
        if self._running >= self.max_prefetch:
            self.stats.prefetch_skipped += 1
            return
        self._running += 1

        async def run() -> None:
            try:
                self.stats.prefetch_blocks += await self.manager.onboard(keys, to=TierName.G2, hit=False)
            except Exception as e:  # a prefetch is a hint; the Onboard that follows reports real errors
                log.debug("prefetch failed: %s", e)
            finally:
                self._running -= 1

        self.stats.prefetches += 1
        self._spawn(run())
