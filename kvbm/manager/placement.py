"""The placement policy: admission, eviction and promotion decided in one place (``policy.eviction``).

``lru`` (the default): a tier's victims are its least recently used unpinned blocks (:meth:`Registry.victims`);
every store is admitted, a hit promotes to G2 (the Onboard) and writes through below.

``frequency``: frequency classes with ageing, measured on a production trace (docs/traces.md). Each block has a
reference count (a store of a block new to every tier, then each hit), kept for a while after the block left
every tier (a ghost count: a block stored again keeps its history). Per tier, the blocks of each class (count
1, 2, ... ``classes`` and above) are in LRU order; a victim is the least recently used block of the class whose
oldest block has the lowest *hit density* ``weight[class] / (age + age0_s)``: the chance a block of that class
is referenced again (measured: 0.24 after one reference, 0.42 after two, 0.50, 0.58, ... 0.75) over how long it
has already waited. A one-off block therefore leaves after about ``age0_s`` seconds unused while a block seen
five times stays ~2.5x longer; nothing is refused outright (an admission filter cost hit ratio on the trace).
Promotion: a G4 hit onboards through G2 and writes through to G3 with its count, so a block worth keeping
competes there by its history, not as a newcomer.

Under both, a tier's never-hit partial blocks (:mod:`kvbm.index.partials`) are its first victims, least recently
used first; the policy orders the rest.

:func:`kvbm.manager.policy_sim.simulate` runs the same eviction rule over a list of requests (prefix hits) for
``kvbm bench trace``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from kvbm.blocks import BlockKey

# P(referenced again | referenced n times so far), n = 1.. (measured on the Mooncake conversation trace).
DEFAULT_WEIGHTS = (0.24, 0.42, 0.50, 0.58, 0.62, 0.66, 0.70, 0.75)
DEFAULT_AGE0_S = 600.0


class FrequencyClasses:
    """Per tier, ``classes`` LRU orders of (key -> last use); the eviction rule of the ``frequency`` policy.

    Not thread-safe by itself: the manager calls it from its event loop (the registry's listeners run there)."""

    def __init__(self, tiers: Sequence[str], *, weights: Sequence[float] = DEFAULT_WEIGHTS,
                 age0_s: float = DEFAULT_AGE0_S, ghost_blocks: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not weights or any(not 0 < w <= 1 for w in weights):
            raise ValueError("policy.weights: probabilities in (0, 1] are required")
        if age0_s <= 0:
            raise ValueError("policy.age0_s must be > 0")
        self.weights = tuple(weights)
        self.classes = len(self.weights)
        self.age0_s = age0_s
        self.ghost_blocks = max(0, ghost_blocks)
        self.clock = clock
        self.counts: OrderedDict[Hashable, int] = OrderedDict()  # references, oldest update first (ghosts too)
        self._tiers: dict[str, list[OrderedDict[Hashable, float]]] = {
            t: [OrderedDict() for _ in range(self.classes)] for t in tiers}
        self._cls: dict[str, dict[Hashable, int]] = {t: {} for t in tiers}

    # -- events ---------------------------------------------------------------------------------------
    def _class(self, key: Hashable) -> int:
        return min(self.counts.get(key, 1), self.classes) - 1

    def _count(self, key: Hashable, add: int) -> None:
        c = self.counts.pop(key, 0) + add
        self.counts[key] = c
        while len(self.counts) > self.ghost_blocks:
            self.counts.popitem(last=False)

    def stored(self, tier: str, keys: Iterable[Hashable], new: bool) -> None:
        """``keys`` now in ``tier``; ``new``: a reference (a block no tier held was stored)."""
        now = self.clock()
        lrus, cls = self._tiers[tier], self._cls[tier]
        for k in keys:
            if new:
                self._count(k, 1)
            old = cls.pop(k, None)
            if old is not None:
                lrus[old].pop(k, None)
            c = self._class(k)
            lrus[c][k] = now
            cls[k] = c

    def removed(self, tier: str, keys: Iterable[Hashable]) -> None:
        lrus, cls = self._tiers[tier], self._cls[tier]
        for k in keys:
            c = cls.pop(k, None)
            if c is not None:
                lrus[c].pop(k, None)

    def hit(self, keys: Iterable[Hashable], held: Callable[[str, Hashable], bool] | None = None) -> None:
        """A reference to each of ``keys``: counted, and moved to its class's most recent end in every tier."""
        now = self.clock()
        for k in keys:
            self._count(k, 1)
            c = self._class(k)
            for tier, lrus in self._tiers.items():
                old = self._cls[tier].get(k)
                if old is None:
                    continue
                lrus[old].pop(k, None)
                lrus[c][k] = now
                self._cls[tier][k] = c

    # -- eviction -------------------------------------------------------------------------------------
    def density(self, cls: int, last: float, now: float) -> float:
        return self.weights[cls] / (now - last + self.age0_s)

    def order(self, tier: str, pinned: Callable[[Hashable], bool], limit: int) -> list[Hashable]:
        """Up to ``limit`` unpinned blocks of ``tier``, lowest hit density first."""
        now = self.clock()
        lrus = self._tiers[tier]
        its = [iter(d.items()) for d in lrus]  # nothing changes them while this walks (no await here)
        heads: list[tuple[Hashable, float] | None] = [next(it, None) for it in its]
        out: list[Hashable] = []
        while len(out) < limit:
            best, bd = -1, 0.0
            for c, h in enumerate(heads):
                if h is None:
                    continue
                d = self.density(c, h[1], now)
                if best < 0 or d < bd:
                    best, bd = c, d
            if best < 0:
                break
            key = heads[best][0]  # type: ignore[index]
            heads[best] = next(its[best], None)
            if not pinned(key):
                out.append(key)
        return out

    def __len__(self) -> int:
        return sum(len(c) for c in self._cls.values())


class PlacementPolicy:
    """The manager's placement policy (see the module docstring); ``eviction`` is ``lru`` or ``frequency``."""

    def __init__(self, registry: Any, tiers: Sequence[str], eviction: str = "lru", **kw: Any) -> None:
        if eviction not in ("lru", "frequency"):
            raise ValueError(f"policy.eviction: lru or frequency, not {eviction!r}")
        self.eviction = eviction
        self.registry = registry
        self.freq: FrequencyClasses | None = None
        if eviction == "frequency":
            self.freq = FrequencyClasses(tiers, **kw)
            self.attach(registry)

    def attach(self, registry: Any) -> None:
        """Follow ``registry``'s changes (stores, removals, hits); a registry swapped in later is attached again."""
        self.registry = registry
        if self.freq is None:
            return
        freq = self.freq

        def on_change(kind: str, tier: str, keys: list[BlockKey]) -> None:
            if kind == "stored":
                # A reference only when no other tier already held the block (a cascade or a promotion is not one).
                new = [k for k in keys if registry.where(k) == [tier]]
                freq.stored(tier, new, True)
                if len(new) < len(keys):
                    ns = set(new)
                    freq.stored(tier, [k for k in keys if k not in ns], False)
            elif kind == "removed":
                freq.removed(tier, keys)

        registry.listeners.append(on_change)
        registry.hit_listeners.append(freq.hit)

    def promotes(self, tiers: Sequence[Any], where: Sequence[str], target: str) -> bool:
        """Whether a block brought up into ``target`` from ``where`` is also written to the tiers between (a G4 hit
        into G3): with ``frequency`` yes, as a store would be; without it a block that returned from S3 lives in
        G2 alone, and G3 serves almost nothing once S3 is on (measured: 0.0015 of references vs 0.022 with S3 off)."""
        if self.freq is None or not where:
            return False
        names = [t.name for t in tiers]
        if target not in names or where[0] not in names:
            return False
        between = names[names.index(target) + 1 : names.index(where[0])]
        return bool(between)

    def victims(self, tier: str, need: int, capacity: int) -> list[BlockKey]:
        """Unpinned blocks of ``tier`` whose removal frees room for ``need`` bytes ([] when there is room);
        LookupError when pinned blocks make it impossible (as :meth:`Registry.victims`)."""
        reg = self.registry
        if self.freq is None:
            return reg.victims(tier, need, capacity)
        excess = reg.used(tier) + need - capacity
        if excess <= 0:
            return []
        per = max(1, reg.footprint(tier))
        want = -(-excess // per)
        # Never-hit partial blocks go first under every policy (kvbm.index.partials): one-off tails, whatever
        # their reference counts say; the frequency classes order the rest.
        out: list[Any] = reg.victims(tier, need, capacity, partials_only=True)
        if len(out) < want:
            chosen = set(out)
            out += self.freq.order(tier, lambda k: k in chosen or reg.is_pinned(k, tier), want - len(out))
        if len(out) < want:
            raise LookupError(f"{tier}: not enough unpinned blocks to free {need} bytes")
        return out

