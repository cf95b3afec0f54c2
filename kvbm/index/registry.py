"""Which tier holds which block: per-tier LRU order and usage, access counts, and pins.

The registry is the manager's bookkeeping only; tiers keep their own storage index. All methods are
guarded by one lock so the registry is safe from threads and from the event loop (every operation is
a few dict operations, so the lock is held for microseconds).

Memory layout (about 90 bytes per block in one tier, 130 in two; see ``kvbm bench manager``): a block
is not kept as a :class:`BlockKey` but as one Python int packing the namespace id, the hash length and
the hash (:mod:`kvbm.index.keycodes`). Each tier is a plain insertion-ordered dict ``code -> code`` whose
order is that tier's LRU order (a touch re-inserts at the end). The value is the key itself, so a block
held in several tiers shares one int object (adding it to a second tier looks the canonical object up
in the first). Footprints are stored once per tier (the most common one) plus a sparse dict of the blocks
whose footprint differs. Dead entries that re-inserts and removals leave at the front of a tier's dict
are skipped by :meth:`victims` in C and dropped when the dict resizes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import takewhile

from kvbm.blocks import BlockKey
from kvbm.index.footprints import Footprints
from kvbm.index.keycodes import KeyCodes
from kvbm.index.partials import PartialMarks, lru_victims, marker
from kvbm.index.pinning import PinTable


class Registry:
    def __init__(self, tiers: Sequence[str]) -> None:
        self.tiers = list(tiers)
        self._lock = threading.RLock()
        self._ti: dict[str, int] = {t: i for i, t in enumerate(self.tiers)}
        # Per tier: code -> code (the canonical int); insertion order is LRU order (oldest first).
        self._lru: list[dict[int, int]] = [{} for _ in self.tiers]
        self._sizes = [Footprints() for _ in self.tiers]
        self._kc = KeyCodes(self._lock)
        # The key codes' methods, bound once: they run per block on every hot path.
        self._code, self._peek, self._key, self._codes = self._kc.code, self._kc.peek, self._kc.key, self._kc.codes
        self._pin_table = PinTable(self._lock, self._ti, self._codes, self._peek)
        self._pins = self._pin_table.pins  # read by victims() under the lock
        t = self._pin_table  # pin, unpin, pinned, is_pinned: the pin table's own (kvbm.index.pinning)
        self.pin, self.unpin, self.pinned, self.is_pinned = t.pin, t.unpin, t.pinned, t.is_pinned
        self._hits: dict[int, int] = {}
        self.partials = PartialMarks(len(self.tiers))  # partial blocks, evicted first until hit (kvbm.index.partials)
        self._kinds, self._unhit = self.partials.kinds, self.partials.unhit  # its sets (never replaced), bound once
        self.mark_partial = marker(self._lock, self._ti, self._lru, self._hits, self._peek, self.partials)
        # Called as listener(kind, tier, keys) with kind "stored" or "removed" and the blocks that changed (one
        # call per batch: a store of 64 blocks is one call, not 64), outside the lock.
        self.listeners: list[Callable[[str, str, list[BlockKey]], None]] = []
        # Called as hit_listener(keys) for every recorded hit, outside the lock (kvbm.fleet.recency).
        self.hit_listeners: list[Callable[[list[BlockKey]], None]] = []

    # -- tier dicts ----------------------------------------------------------------------------------
    def _canonical(self, code: int) -> int:
        """The int object already stored for ``code`` in any tier (so tiers share it), else ``code``."""
        for d in self._lru:
            c = d.get(code)
            if c is not None:
                return c
        return code

    def _emit(self, kind: str, tier: str, keys: list[BlockKey]) -> None:
        for fn in self.listeners:
            fn(kind, tier, keys)

    # -- membership ------------------------------------------------------------------------------
    def add(self, tier: str, key: BlockKey, footprint: int, *, partial: bool = False) -> None:
        i = self._ti[tier]
        code = self._code(key)
        with self._lock:
            new = self._add(i, code, footprint, partial)
        if new and self.listeners:
            self._emit("stored", tier, [key])

    def add_many(self, tier: str, keys: Sequence[BlockKey], footprint: int, *, partial: bool = False) -> int:
        """:meth:`add` of a batch of equal-footprint blocks under one lock, heard by listeners as one
        change; returns how many were new in ``tier``. ``partial``: they are partial blocks (evicted first till hit)."""
        i = self._ti[tier]
        codes = self._codes(keys)
        with self._lock:
            if self._sizes[i].base == footprint and not self._sizes[i].odd and not partial:
                new = self._add_base(i, keys, codes, footprint)
            else:
                new = [k for k, code in zip(keys, codes, strict=True) if self._add(i, code, footprint, partial)]
        if new and self.listeners:
            self._emit("stored", tier, new)
        return len(new)

    def _add_base(self, i: int, keys: Sequence[BlockKey], codes: list[int], footprint: int) -> list[BlockKey]:
        """:meth:`_add` of a batch whose footprint is tier ``i``'s base one (no exceptions to keep), under the
        lock: the common store of equal-size blocks. Returns the keys that were new there."""
        lru = self._lru[i]
        others = [d for j, d in enumerate(self._lru) if j != i and d]  # where a canonical int may already live
        unhit = self._unhit
        new: list[BlockKey] = []
        for key, code in zip(keys, codes, strict=True):
            c = lru.pop(code, None)
            if c is None:
                for d in others:
                    c = d.get(code)
                    if c is not None:
                        break
                else:
                    c = code
                new.append(key)
            lru[c] = c
            if unhit and c in unhit:  # a cascade's copy of a never-hit partial block: evicted first here too
                self.partials.added(i, c, False)
        self._sizes[i].used += footprint * len(new)  # a re-added block already counted the same base footprint
        return new

    def _add(self, i: int, code: int, footprint: int, partial: bool = False) -> bool:
        """Insert (or move to the LRU end) ``code`` in tier ``i``, under the lock; whether it was new there."""
        lru, sizes = self._lru[i], self._sizes[i]
        c = lru.pop(code, None)
        new = c is None
        if new:
            c = self._canonical(code)
        else:
            sizes.pop(c)
        lru[c] = c
        sizes.put(c, footprint, lru)
        if partial or self._unhit:
            self.partials.added(i, c, partial)
        return new

    def remove(self, tier: str, key: BlockKey) -> bool:
        """Forget tier ``tier``'s copy of ``key``; whether it held one."""
        return self.remove_many(tier, (key,)) == 1

    def remove_many(self, tier: str, keys: Sequence[BlockKey]) -> int:
        """:meth:`remove` of a batch under one lock, heard by listeners as one change; returns how many it held."""
        i = self._ti[tier]
        gone: list[BlockKey] = []
        with self._lock:
            lru, sizes = self._lru[i], self._sizes[i]
            for key in keys:
                code = self._peek(key)
                c = lru.pop(code, None)
                if c is None:
                    continue
                sizes.pop(c)
                gone.append(key)
                if self._hits or self._kinds:  # per-block state ends with the last copy
                    anywhere = any(code in d for d in self._lru)
                    if not anywhere:
                        self._hits.pop(code, None)
                    if self._kinds:
                        self.partials.removed(i, code, anywhere)
        if gone and self.listeners:
            self._emit("removed", tier, gone)
        return len(gone)

    def holds(self, tier: str, key: BlockKey) -> bool:
        return self._peek(key) in self._lru[self._ti[tier]]

    def holding(self, tier: str, keys: Sequence[BlockKey]) -> list[bool]:
        """:meth:`holds` for each of ``keys`` (one pass in C for a one-namespace batch)."""
        codes = self._codes(keys, intern=False)
        held = list(map(self._lru[self._ti[tier]].__contains__, codes))
        if len(held) < len(keys):  # a key of a namespace never registered: none of it is held
            held += [self.holds(tier, k) for k in keys[len(held) :]]
        return held

    def where(self, key: BlockKey) -> list[str]:
        """Tiers holding ``key``, fastest first."""
        code = self._peek(key)
        return [t for t, d in zip(self.tiers, self._lru, strict=True) if code in d]

    def touch(self, tier: str, key: BlockKey) -> None:
        i = self._ti[tier]
        code = self._peek(key)
        with self._lock:
            lru = self._lru[i]
            c = lru.pop(code, None)
            if c is not None:
                lru[c] = c

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[str]:
        """For the leading run of ``keys`` present in some tier: the fastest tier of each."""
        return self._match(self._codes(keys, intern=False))

    def match_hashes(self, namespace: str, hashes: Sequence[bytes]) -> list[str]:
        """:meth:`match_prefix` for one namespace's hashes as a request carries them (no BlockKey built)."""
        codes = self._kc.of_hashes(namespace, hashes)
        return [] if codes is None else self._match(codes)

    def _match(self, codes: list[int]) -> list[str]:
        with self._lock:
            # Tiers with no blocks cannot match: skip them (a prefix held in G3 alone is then one C-level
            # pass over one dict).
            lrus = [(t, d) for t, d in zip(self.tiers, self._lru, strict=True) if d]
            if len(lrus) == 1:
                t, d = lrus[0]
                return [t] * len(list(takewhile(d.__contains__, codes)))
            out: list[str] = []
            for code in codes:
                for t, d in lrus:
                    if code in d:
                        out.append(t)
                        break
                else:
                    break
        return out

    def record_hit(self, keys: Iterable[BlockKey]) -> None:
        keys = list(keys)
        codes = self._codes(keys)
        with self._lock:
            hits = self._hits
            for code in codes:
                code = self._canonical(code)
                hits[code] = hits.get(code, 0) + 1
                if self._unhit:
                    self.partials.hit(code)
                for lru in self._lru:
                    c = lru.pop(code, None)
                    if c is not None:
                        lru[c] = c
        for fn in self.hit_listeners:
            fn(keys)

    def hits(self, key: BlockKey) -> int:
        return self._hits.get(self._peek(key), 0)  # type: ignore[arg-type]

    def is_partial(self, key: BlockKey) -> bool:
        """Whether ``key`` was stored as a partial block (and some tier still holds it)."""
        return self._peek(key) in self.partials.kinds

    # -- capacity -------------------------------------------------------------------------------------
    def used(self, tier: str) -> int:
        return self._sizes[self._ti[tier]].used

    def footprint(self, tier: str) -> int:
        """The footprint most of ``tier``'s blocks have (its base one; 0 while it has none)."""
        return self._sizes[self._ti[tier]].base or 0

    def count(self, tier: str) -> int:
        return len(self._lru[self._ti[tier]])

    def keys(self, tier: str) -> list[BlockKey]:
        return list(self.iter_keys(tier))

    def iter_keys(self, tier: str) -> Iterator[BlockKey]:
        """``tier``'s keys as of the call (LRU order), each made only when reached: a caller walking a big tier
        in batches (yielding to the event loop between them) pays for one batch at a time."""
        with self._lock:
            codes = list(self._lru[self._ti[tier]])
        return map(self._key, codes)

    def victims(self, tier: str, need: int, capacity: int, *, partials_only: bool = False) -> list[BlockKey]:
        """Least-recently-used unpinned blocks of ``tier`` whose removal frees room for ``need`` bytes, never-hit
        partial blocks first. Returns [] when the room is already there; raises LookupError when pinned blocks make
        it impossible. ``partials_only``: only those partial blocks, as many as there are (never raises).
        """
        i = self._ti[tier]
        with self._lock:
            sizes = self._sizes[i]
            excess = sizes.used + need - capacity
            if excess <= 0:
                return []
            out = lru_victims(self._lru[i], self.partials.first[i], sizes, excess, self._pins.counts, i, partials_only)
            if out is None:
                raise LookupError(f"{tier}: not enough unpinned blocks to free {need} bytes")
            return [self._key(c) for c in out]

    def __len__(self) -> int:
        with self._lock:
            lrus = [d for d in self._lru if d]
            if len(lrus) <= 1:
                return len(lrus[0]) if lrus else 0
            seen: set[int] = set()
            for d in lrus:
                seen.update(d)
            return len(seen)
