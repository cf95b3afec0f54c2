"""Bytes a tier's blocks take, kept in O(1) memory per block: one base footprint (the most common) plus a
sparse dict of the blocks whose footprint differs (a partial last block, another layout's size)."""

from __future__ import annotations


class Footprints:
    """One tier's footprints and their total, ``used``. Guarded by the registry's lock."""

    __slots__ = ("base", "odd", "rebase_at", "used")

    def __init__(self) -> None:
        self.base: int | None = None  # the footprint of most blocks, re-picked as the exceptions grow
        self.odd: dict[int, int] = {}  # code -> footprint, where it is not ``base``
        self.rebase_at = 64  # re-pick ``base`` when ``odd`` reaches this many (doubles: amortized O(1))
        self.used = 0

    def of(self, code: int) -> int:
        odd = self.odd
        if odd:
            fp = odd.get(code)
            if fp is not None:
                return fp
        return self.base or 0

    def put(self, code: int, footprint: int, held: dict[int, int]) -> None:
        """Count ``code`` (new, or re-added after :meth:`pop`/its old footprint was taken off) at ``footprint``;
        ``held`` is every block of the tier, for a rebase."""
        base = self.base
        if base is None:
            self.base = base = footprint
        odd = self.odd
        if footprint != base:
            odd[code] = footprint
            if len(odd) >= self.rebase_at:
                self._rebase(held)
        elif odd:
            odd.pop(code, None)
        self.used += footprint

    def pop(self, code: int) -> int:
        """Take ``code`` off the total; returns its footprint."""
        odd = self.odd
        fp = (odd.pop(code, None) if odd else None) or self.base or 0
        self.used -= fp
        return fp

    def _rebase(self, held: dict[int, int]) -> None:
        """Make the most common footprint the base (the first block may have been a partial one), so the
        exceptions dict holds only the rare ones."""
        odd, base = self.odd, self.base
        counts: dict[int, int] = {}
        for fp in odd.values():
            counts[fp] = counts.get(fp, 0) + 1
        best = max(counts, key=counts.__getitem__)
        if counts[best] > len(held) - len(odd):
            self.odd = odd = {c: odd.get(c, base) for c in held if odd.get(c, base) != best}  # type: ignore
            self.base = best
        self.rebase_at = max(64, 2 * len(odd))
