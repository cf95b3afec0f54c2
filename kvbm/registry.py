"""Which tier holds which block: per-tier LRU order and usage, access counts, and pins.

The registry is the manager's bookkeeping only; tiers keep their own storage index. All methods are
guarded by one lock so the registry is safe from threads and from the event loop (every operation is
a few dict operations, so the lock is held for microseconds).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvbm.blocks import BlockKey


class Registry:
    def __init__(self, tiers: Sequence[str]) -> None:
        self.tiers = list(tiers)
        self._lock = threading.RLock()
        # tier -> key -> footprint; insertion order is LRU order (oldest first).
        self._lru: dict[str, OrderedDict[BlockKey, int]] = {t: OrderedDict() for t in self.tiers}
        self._used: dict[str, int] = dict.fromkeys(self.tiers, 0)
        # (tier, key) -> count; tier None pins the block in every tier.
        self._pins: dict[tuple[str | None, BlockKey], int] = {}
        self._hits: dict[BlockKey, int] = {}
        # Called as listener(kind, tier, key) with kind "stored" or "removed", outside the lock.
        self.listeners: list[Callable[[str, str, BlockKey], None]] = []
        # Called as hit_listener(keys) for every recorded hit, outside the lock (kvbm.recency).
        self.hit_listeners: list[Callable[[list[BlockKey]], None]] = []

    def _emit(self, kind: str, tier: str, key: BlockKey) -> None:
        for fn in self.listeners:
            fn(kind, tier, key)

    # -- membership ------------------------------------------------------------------------------
    def add(self, tier: str, key: BlockKey, footprint: int) -> None:
        with self._lock:
            lru = self._lru[tier]
            old = lru.pop(key, None)
            if old is not None:
                self._used[tier] -= old
            lru[key] = footprint
            self._used[tier] += footprint
        if old is None and self.listeners:
            self._emit("stored", tier, key)

    def remove(self, tier: str, key: BlockKey) -> bool:
        with self._lock:
            fp = self._lru[tier].pop(key, None)
            if fp is None:
                return False
            self._used[tier] -= fp
            if not any(key in self._lru[t] for t in self.tiers):
                self._hits.pop(key, None)
        if self.listeners:
            self._emit("removed", tier, key)
        return True

    def holds(self, tier: str, key: BlockKey) -> bool:
        return key in self._lru[tier]

    def where(self, key: BlockKey) -> list[str]:
        """Tiers holding ``key``, fastest first."""
        return [t for t in self.tiers if key in self._lru[t]]

    def touch(self, tier: str, key: BlockKey) -> None:
        with self._lock:
            lru = self._lru[tier]
            if key in lru:
                lru.move_to_end(key)

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[str]:
        """For the leading run of ``keys`` present in some tier: the fastest tier of each."""
        out: list[str] = []
        lrus = [(t, self._lru[t]) for t in self.tiers]
        with self._lock:
            for key in keys:
                for t, lru in lrus:
                    if key in lru:
                        out.append(t)
                        break
                else:
                    break
        return out

    def record_hit(self, keys: Iterable[BlockKey]) -> None:
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._hits[key] = self._hits.get(key, 0) + 1
                for t in self.tiers:
                    lru = self._lru[t]
                    if key in lru:
                        lru.move_to_end(key)
        for fn in self.hit_listeners:
            fn(keys)

    def hits(self, key: BlockKey) -> int:
        return self._hits.get(key, 0)

    # -- pins ---------------------------------------------------------------------------------------
    def pin(self, keys: Iterable[BlockKey], tier: str | None = None) -> None:
        """Keep ``keys`` from being evicted from ``tier`` (None: from every tier)."""
        with self._lock:
            for key in keys:
                self._pins[(tier, key)] = self._pins.get((tier, key), 0) + 1

    def unpin(self, keys: Iterable[BlockKey], tier: str | None = None) -> None:
        with self._lock:
            for key in keys:
                n = self._pins.get((tier, key), 0) - 1
                if n > 0:
                    self._pins[(tier, key)] = n
                else:
                    self._pins.pop((tier, key), None)

    @contextmanager
    def pinned(self, keys: Sequence[BlockKey], tier: str | None = None) -> Iterator[None]:
        self.pin(keys, tier)
        try:
            yield
        finally:
            self.unpin(keys, tier)

    def is_pinned(self, key: BlockKey, tier: str | None = None) -> bool:
        pins = self._pins
        return (None, key) in pins or (tier is not None and (tier, key) in pins)

    # -- capacity -------------------------------------------------------------------------------------
    def used(self, tier: str) -> int:
        return self._used[tier]

    def count(self, tier: str) -> int:
        return len(self._lru[tier])

    def keys(self, tier: str) -> list[BlockKey]:
        with self._lock:
            return list(self._lru[tier])

    def victims(self, tier: str, need: int, capacity: int) -> list[BlockKey]:
        """Least-recently-used unpinned blocks of ``tier`` whose removal frees room for ``need`` bytes.

        Returns [] when the room is already there; raises LookupError when pinned blocks make it
        impossible.
        """
        with self._lock:
            excess = self._used[tier] + need - capacity
            if excess <= 0:
                return []
            out: list[BlockKey] = []
            pins = self._pins
            for key, fp in self._lru[tier].items():
                if (None, key) in pins or (tier, key) in pins:
                    continue
                out.append(key)
                excess -= fp
                if excess <= 0:
                    return out
            raise LookupError(f"{tier}: not enough unpinned blocks to free {need} bytes")

    def __len__(self) -> int:
        with self._lock:
            seen: set[BlockKey] = set()
            for lru in self._lru.values():
                seen.update(lru)
            return len(seen)
