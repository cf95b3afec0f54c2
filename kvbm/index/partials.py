"""Partial blocks in the registry: which blocks are partial, and which of those no onboard ever hit.

A *partial block* is a request's tail past its last full block (the vLLM connector stores it under vLLM's hash of
its last vLLM block; the worker says so in its CommitStore). It is often a one-off, so a tier evicts the partial
blocks nobody hit before any other block, each in LRU order; once hit it is an ordinary block. The marks are per
block (a cascade's copy in a lower tier is marked too) and end when no tier holds it any more. Codes are the
registry's (:mod:`kvbm.index.keycodes`); every method runs under the registry's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from itertools import chain
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.index.footprints import Footprints


class PartialMarks:
    """The partial blocks (``kinds``), the never-hit ones (``unhit``) and, per tier, those in LRU order (``first``)."""

    def __init__(self, ntiers: int) -> None:
        self.kinds: set[int] = set()
        self.unhit: set[int] = set()
        self.first: list[dict[int, int]] = [{} for _ in range(ntiers)]  # code -> code, oldest first (as a tier's LRU)

    def added(self, i: int, code: int, partial: bool) -> None:
        """``code`` was stored (or re-stored) in tier ``i``; ``partial``: as a partial block (never un-marks)."""
        if partial and code not in self.kinds:
            self.kinds.add(code)
            self.unhit.add(code)
        if code in self.unhit:
            first = self.first[i]
            first.pop(code, None)
            first[code] = code

    def mark(self, i: int, codes: Iterable[int | None], held: Mapping[int, int], hits: Mapping[int, int]) -> int:
        """Mark partial, in place, the blocks of ``codes`` that tier ``i`` holds (``held``: its LRU, code -> canonical
        code) and no onboard hit (``hits``): blocks found to be partial after they were indexed (a bucket listing
        shows no header flags). How many were marked."""
        n = 0
        for code in codes:
            c = held.get(code) if code is not None else None
            if c is None or c in self.kinds or hits.get(c):
                continue
            self.added(i, c, True)
            n += 1
        return n

    def removed(self, i: int, code: int, anywhere: bool) -> None:
        """Tier ``i`` let go of ``code``; ``anywhere``: another tier still holds it."""
        self.first[i].pop(code, None)
        if not anywhere and code in self.kinds:
            self.kinds.discard(code)
            self.unhit.discard(code)

    def counts(self) -> dict[str, int]:
        """Partial blocks held, and of them never hit (the manager's stats)."""
        return {"partial_blocks": len(self.kinds), "partial_blocks_unhit": len(self.unhit)}

    def hit(self, code: int) -> None:
        """An onboard hit ``code``: from now on it is evicted like any block."""
        if code in self.unhit:
            self.unhit.discard(code)
            for first in self.first:
                first.pop(code, None)


def marker(lock: AbstractContextManager[Any], ti: Mapping[str, int], lru: Sequence[Mapping[int, int]],
           hits: Mapping[int, int], peek: Callable[[BlockKey], int | None],
           marks: PartialMarks) -> Callable[[str, Iterable[BlockKey]], int]:
    """The registry's ``mark_partial(tier, keys)``: :meth:`PartialMarks.mark` of the blocks ``keys`` under its lock
    (``ti``: tier indexes, ``lru``: each tier's LRU, ``hits``: hit counts, ``peek``: a key's code)."""

    def mark_partial(tier: str, keys: Iterable[BlockKey]) -> int:
        """Mark the never-hit blocks of ``keys`` that ``tier`` holds partial, in place (no LRU move, no event)."""
        with lock:
            return marks.mark(ti[tier], map(peek, keys), lru[ti[tier]], hits)

    return mark_partial


def lru_victims(lru: dict[int, int], first: dict[int, int], sizes: Footprints, excess: int,
                pins: Mapping[tuple[int | None, int], int], i: int, partials_only: bool = False) -> list[int] | None:
    """Unpinned codes of one tier whose footprints add up to ``excess`` bytes: its never-hit partial blocks
    (``first``) in LRU order, then the rest of its LRU order (``lru``); None when the unpinned ones are too few.
    ``pins``: the pin table's counts, by (tier index or None for every tier, code); ``i``: this tier's index.
    ``partials_only``: the never-hit partial blocks alone, as many as there are up to ``excess`` (another eviction
    policy orders the rest)."""
    out: list[int] = []
    odd, base = sizes.odd, sizes.base or 0
    # A never-hit partial block is in the LRU order too: walked once, in the first pass.
    order = first if partials_only else chain(first, (c for c in lru if c not in first)) if first else lru
    for c in order:
        if pins and ((None, c) in pins or (i, c) in pins):
            continue
        out.append(c)
        excess -= odd.get(c, base) if odd else base
        if excess <= 0:
            return out
    return out if partials_only else None
