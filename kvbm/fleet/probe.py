"""Bucket probes: when a lookup's leading run ends at a block the index lacks, ask the shared bucket whether
another node stored the next blocks of the prefix.

A probe HEADs the blocks after the run in order, ``concurrency`` at a time, and stops at the first window with
a block the bucket lacks (the run cannot go past it). Found blocks are handed to ``learn`` (the daemon indexes
them as G4); missing ones go into a :class:`NegativeCache` for ``ttl_s``, so a hot miss costs one HEAD per TTL
instead of one per lookup. Probes of the same next block are coalesced. The caller decides how long a lookup
waits for its probe (``daemon.probe_budget_ms``); a probe that outlives the budget still fills the index for
the next lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from kvbm.blocks import BlockKey
from kvbm.errors import TierUnavailableError
from kvbm.tiers.s3 import S3Tier

log = logging.getLogger(__name__)


class NegativeCache:
    """Blocks the bucket did not hold when last asked, each remembered for ``ttl_s`` (at most ``max_entries``,
    the oldest leaving first)."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self.clock = clock
        self._until: OrderedDict[BlockKey, float] = OrderedDict()  # insertion order = expiry order (one TTL)

    def _expire(self) -> None:
        now = self.clock()
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[key]

    def add(self, key: BlockKey) -> None:
        if self.ttl_s <= 0:
            return
        self._until.pop(key, None)
        self._until[key] = self.clock() + self.ttl_s
        self._expire()
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def hit(self, key: BlockKey) -> bool:
        """Whether ``key`` is known missing (and not expired)."""
        until = self._until.get(key)
        if until is None:
            return False
        if self.clock() >= until:
            del self._until[key]
            return False
        return True

    def discard(self, key: BlockKey) -> None:
        self._until.pop(key, None)

    def clear(self) -> None:
        self._until.clear()

    def __len__(self) -> int:
        self._expire()
        return len(self._until)


class ProbeStats(msgspec.Struct):
    probes: int = 0  # probes started
    joined: int = 0  # lookups that joined a probe of the same block already in flight
    probed: int = 0  # blocks asked about (one HEAD each)
    found: int = 0  # ... that the bucket held (now indexed)
    missed: int = 0  # ... that it lacked (now negative-cached)
    negative_hits: int = 0  # lookups whose next block was known missing: no HEAD
    failed: int = 0  # probes that could not ask (S3 unreachable, breaker open)
    late: int = 0  # lookups answered before their probe finished (the budget ran out)


class BucketProbe:
    """Existence probes of one S3 tier on behalf of lookups; see the module docstring."""

    def __init__(self, tier: S3Tier, learn: Callable[[dict[BlockKey, int]], None], *, concurrency: int = 8,
                 max_blocks: int = 64, negative_ttl_s: float = 1.0, negative_max: int = 100_000) -> None:
        self.tier = tier
        self.learn = learn
        self.concurrency = max(1, concurrency)
        self.max_blocks = max(1, max_blocks)
        self.negative = NegativeCache(negative_ttl_s, negative_max)
        self.stats = ProbeStats()
        self._running: dict[BlockKey, asyncio.Task[int]] = {}

    def start(self, keys: Sequence[BlockKey]) -> asyncio.Task[int] | None:
        """Probe the blocks after a lookup's run (``keys``, in prefix order). Returns the probe (its result: how
        many leading ``keys`` the bucket holds), or None when there is nothing to ask: the first block is
        known missing, or the tier cannot be asked now."""
        if not keys:
            return None
        first = keys[0]
        task = self._running.get(first)
        if task is not None:
            self.stats.joined += 1
            return task
        if self.negative.hit(first):
            self.stats.negative_hits += 1
            return None
        if not (self.tier.online and self.tier.breaker.would_allow()):
            self.stats.failed += 1
            return None
        batch: list[BlockKey] = []
        for k in keys[: self.max_blocks]:
            if batch and self.negative.hit(k):
                break
            batch.append(k)
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running[first] = task
        task.add_done_callback(lambda t: self._running.pop(first, None) if self._running.get(first) is t else None)
        self.stats.probes += 1
        return task

    async def _run(self, keys: list[BlockKey]) -> int:
        run = 0
        for i in range(0, len(keys), self.concurrency):
            window = keys[i : i + self.concurrency]
            try:
                got = await self.tier.exists_many(window, self.concurrency)
            except TierUnavailableError as e:
                self.stats.failed += 1
                log.debug("bucket probe failed: %s", e)
                return run
            except Exception as e:  # a probe is a hint: never let it take anything down
                self.stats.failed += 1
                log.warning("bucket probe failed: %s: %s", type(e).__name__, e)
                return run
            self.stats.probed += len(window)
            hits = {k: n for k, n in got.items() if n is not None}
            for k, n in got.items():
                if n is None:
                    self.negative.add(k)
            self.stats.found += len(hits)
            self.stats.missed += len(got) - len(hits)
            if hits:
                self.learn(hits)
            for k in window:
                if got.get(k) is None:  # missing, or its HEAD failed: the run ends here
                    return run
                run += 1
        return run

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = msgspec.structs.asdict(self.stats)
        d["negative_cache"] = len(self.negative)
        d["in_flight"] = len(self._running)
        d["hit_rate"] = round(self.stats.found / self.stats.probed, 4) if self.stats.probed else None
        return d
