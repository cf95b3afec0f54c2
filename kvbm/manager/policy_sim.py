"""The placement policy's eviction rule replayed over a list of requests, offline: how many prefix hits a cache of
a given size would have had (``kvbm bench trace`` compares it with LRU and Belady, :mod:`kvbm.bench.trace_sim`).

A request is its block ids, head first; its hit is its longest cached prefix (a block is of no use without its
parents), and every block of it is referenced (the hit prefix hit, the rest stored)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from kvbm.manager.placement import FrequencyClasses


def prefix_hit(ids: Sequence[int], held: Container[int]) -> int:
    """How many of ``ids``, head first, ``held`` holds before the first it does not."""
    n = 0
    for h in ids:
        if h not in held:
            break
        n += 1
    return n


def lru_hits(requests: Iterable[Sequence[int]], capacity: int) -> int:
    """Prefix hits of an LRU cache of ``capacity`` blocks; every block of a request is touched head first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in requests:
        hits += prefix_hit(ids, cache)
        for h in ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def simulate(requests: Sequence[Sequence[int]], capacity: int, *, eviction: str = "frequency",
             times: Sequence[float] | None = None, **kw: Any) -> int:
    """Prefix hits of one cache of ``capacity`` blocks running the policy over ``requests`` (each a list of block
    ids, head first; ``times``: their arrival in seconds, else one a second). Every block of a request is referenced
    (the hit prefix is hit, the rest stored); returns the hit blocks. ``kw``: :class:`FrequencyClasses`' options."""
    if eviction == "lru":
        return lru_hits(requests, capacity)
    t = [0.0]
    freq = FrequencyClasses(["c"], clock=lambda: t[0], **kw)
    held: set[int] = set()
    hits = 0
    for i, ids in enumerate(requests):
        t[0] = times[i] if times is not None else float(i)
        n = prefix_hit(ids, held)
        hits += n
        freq.hit(ids[:n])
        for h in ids[n:]:
            if h in held:  # held, but after a missing parent: a reference all the same
                freq.hit([h])
                continue
            held.add(h)
            freq.stored("c", [h], True)
            if len(held) > capacity:
                (v,) = freq.order("c", lambda k: False, 1)
                held.discard(v)
                freq.removed("c", [v])
    return hits
