"""What the block index learns without moving bytes (owned by the manager, ``BlockManager.index``).

* **Listing a tier** at start or on a rescan (restart recovery, another process's writes): every block
  the tier holds is registered with its footprint.
* **Another node's writes to a shared (S3) tier**, from its events or a bucket probe: ``learn`` indexes
  them (and tells the tier their sizes), ``forget`` drops the ones it deleted; neither does I/O.
* **A lookup asked again** after the index learned more (a probe that finished within the lookup's
  budget): ``relookup`` counts only the hits that were added.
* **Whether a shared-tier entry is a real copy** (``real_copies``), before a durable store or a disk eviction
  relies on it: another node may have purged the object since this one saw it. An entry seen (written, read,
  HEADed, listed) within ``s3.copy_max_age_s`` counts; an older one, or one only a peer's event announced, is
  HEADed again (one batch); the missing ones leave the index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError, TierUnavailableError
from kvbm.manager.state import ManagerState
from kvbm.tiers.base import SharedTier

YIELD_EVERY = 4096  # blocks walked per event-loop turn by the passes over a whole tier


class IndexSync:
    """Teaches the registry about blocks found elsewhere; the manager's lookup counters follow."""

    def __init__(self, state: ManagerState) -> None:
        self.s = state

    async def index_tier(self, name: str, namespace: str | None = None, *, refresh: bool = False) -> int:
        """Load what tier ``name`` holds into the registry; returns blocks found.

        With ``refresh`` the tier first re-reads its backing store for blocks other processes wrote.
        Raises TierUnavailableError when the tier cannot be listed (e.g. S3 is down): the index is then
        incomplete, and the caller decides whether to retry (blocks listed before the failure stay).
        """
        tier = self.s.by_name[name]
        n = 0
        if refresh:
            await tier.refresh(namespace)
        async for sb in tier.scan(namespace):
            self.s.registry.add(name, sb.key, sb.footprint or tier.footprint(sb.nbytes), partial=sb.partial)
            n += 1
        if isinstance(tier, SharedTier):
            # A listing is the bucket's word: what it no longer holds (another node purged it) leaves the registry
            # too, not only the tier's own index (which the scan already dropped it from). The whole index is
            # walked, in batches between which requests are served (a fresh namespace's listing must not stall
            # the daemon for every block another namespace holds).
            sizes: dict[str, tuple[int, int]] = {}  # per namespace, its blocks' shortest and longest payload
            for i, key in enumerate(self.s.registry.iter_keys(name)):
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)
                if namespace is None or key.namespace == namespace:
                    size = tier.nbytes(key)
                    if size is None:
                        self.s.registry.remove(name, key)
                    else:
                        lo, hi = sizes.get(key.namespace, (size, size))
                        sizes[key.namespace] = (min(lo, size), max(hi, size))
            longest = {ns: hi for ns, (lo, hi) in sizes.items() if lo < hi}  # namespaces with blocks of two sizes
            if longest:
                await self._mark_partials(name, longest)
        return n

    async def _mark_partials(self, name: str, longest: dict[str, int]) -> None:
        """A bucket's listing shows no header flags, so a partial block listed there (after a restart that lost the
        disk's copy, or another node's) was indexed as an ordinary one: never evicted first, never superseded by
        its full block, left in the bucket. Every full block of a namespace has one size (its layout's), a
        partial one fewer vLLM blocks: a block shorter than its namespace's longest is partial (``longest``: the
        namespaces holding blocks of several sizes; one with partial blocks alone has none marked)."""
        tier, reg = self.s.by_name[name], self.s.registry
        short: list[BlockKey] = []
        for i, key in enumerate(reg.iter_keys(name)):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            hi = longest.get(key.namespace)
            if hi is not None and (tier.nbytes(key) or hi) < hi:
                short.append(key)
        reg.mark_partial(name, short)  # those still held, in place: a block removed meanwhile stays removed

    async def local_namespaces(self) -> set[str]:
        """The namespaces of the blocks the local (disk) tiers hold, yielding to the loop between batches."""
        out: set[str] = set()
        for tier in self.s.tiers:
            if tier.local_dir is not None:
                for i, key in enumerate(self.s.registry.iter_keys(tier.name)):
                    if i % YIELD_EVERY == 0:
                        await asyncio.sleep(0)
                    out.add(key.namespace)
        return out

    async def real_copies(self, name: str, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Of ``keys``, those tier ``name`` really holds as far as this node knows now (see the module docstring).

        A shared (S3) entry not seen within ``s3.copy_max_age_s`` is HEADed again, all of them in one batch; one
        the bucket lacks is dropped from the index. One whose HEAD failed (S3 down) is not counted, and stays.
        """
        held = [k for k, h in zip(keys, self.s.registry.holding(name, keys), strict=True) if h]
        tier = self.s.by_name[name]
        if not isinstance(tier, SharedTier):
            return set(held)
        real = {k for k in held if tier.seen_within(k)}
        ask = [k for k in held if k not in real]
        if not ask:
            return real
        tier.stats.reconfirms += len(ask)
        try:
            found = await tier.exists_many(ask)
        except TierUnavailableError:
            return real
        for key in ask:
            if key not in found:
                continue  # its HEAD failed: unknown, neither counted nor forgotten
            if found[key] is None:
                tier.stats.stale += 1
                self.s.registry.remove(name, key)
            else:
                real.add(key)
        return real

    def relookup(self, keys: Sequence[BlockKey], before: Sequence[str]) -> list[str]:
        """A lookup again after the index learned more (a bucket probe): counts only the added hits."""
        found = self.s.registry.match_prefix(keys)
        self.s.stats.lookup_hit_blocks += max(0, len(found) - len(before))
        return found

    def learn(self, name: str, found: dict[BlockKey, int]) -> int:
        """Index blocks another node stored in shared tier ``name`` (``{key: payload bytes}``, from its event or a
        bucket probe), without I/O; returns how many were new here."""
        tier = self._shared(name)
        n = 0
        for key, nbytes in found.items():
            if self.s.registry.holds(name, key):
                continue  # already known: leave its LRU position alone
            tier.remember(key, nbytes)
            self.s.registry.add(name, key, tier.footprint(nbytes))
            n += 1
        return n

    def forget(self, name: str, keys: Sequence[BlockKey]) -> int:
        """Drop blocks another node deleted from shared tier ``name`` from the index (no I/O); returns how many
        were indexed. A read of one in flight ends as a miss (404), never with wrong bytes."""
        tier = self._shared(name)
        n = 0
        for key in keys:
            tier.forget(key)
            n += self.s.registry.remove(name, key)
        return n

    def _shared(self, name: str) -> SharedTier:
        tier = self.s.by_name[name]
        if not isinstance(tier, SharedTier):
            raise KvbmError(f"{name} is not a shared (S3) tier")
        return tier
