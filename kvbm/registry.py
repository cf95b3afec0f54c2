"""Which tier holds which block: per-tier LRU order and usage, access counts, and pins.

The registry is the manager's bookkeeping only; tiers keep their own storage index. All methods are
guarded by one lock so the registry is safe from threads and from the event loop (every operation is
a few dict operations, so the lock is held for microseconds).

Memory layout (about 90 bytes per block in one tier, 130 in two; see ``kvbm bench manager``): a block
is not kept as a :class:`BlockKey` but as one Python int packing the namespace id, the hash length and
the hash (:meth:`Registry._code`). Each tier is a plain insertion-ordered dict ``code -> code`` whose
order is that tier's LRU order (a touch re-inserts at the end). The value is the key itself, so a block
held in several tiers shares one int object (adding it to a second tier looks the canonical object up
in the first). Footprints are stored once per tier (the most common one) plus a sparse dict of the blocks
whose footprint differs. Dead entries that re-inserts and removals leave at the front of a tier's dict
are skipped by :meth:`victims` in C and dropped when the dict resizes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import repeat, takewhile
from operator import attrgetter

from kvbm.blocks import BlockKey

# code = int.from_bytes(hash || namespace id (3 bytes) || 0x01, "little"): the top byte 0x01 makes the
# int's bit length give the hash length back, so the packing is injective for any hash length and up to
# 2**24 namespaces. A 16-byte hash packs into a 161-bit int (48 bytes of heap, vs 64 for the bytes).
_NS_BITS = 24
_NS_MASK = (1 << _NS_BITS) - 1
_hash_of = attrgetter("hash")
_ns_of = attrgetter("namespace")


class Registry:
    def __init__(self, tiers: Sequence[str]) -> None:
        self.tiers = list(tiers)
        self._lock = threading.RLock()
        self._ti: dict[str, int] = {t: i for i, t in enumerate(self.tiers)}
        # Per tier: code -> code (the canonical int); insertion order is LRU order (oldest first).
        self._lru: list[dict[int, int]] = [{} for _ in self.tiers]
        self._used: list[int] = [0] * len(self.tiers)
        # Per tier: the footprint of most blocks (re-picked as the exceptions grow) and the exceptions.
        self._fp: list[int | None] = [None] * len(self.tiers)
        self._odd_fp: list[dict[int, int]] = [{} for _ in self.tiers]
        # Re-pick a tier's base footprint when its exceptions reach this many (doubles each time: amortized O(1)).
        self._rebase_at: list[int] = [64] * len(self.tiers)
        # namespace -> its 4-byte code suffix; namespace id -> namespace
        self._suffix: dict[str, bytes] = {}
        self._ns_names: list[str] = []
        # (tier index, code) -> count; tier None pins the block in every tier.
        self._pins: dict[tuple[int | None, int], int] = {}
        self._hits: dict[int, int] = {}
        # Called as listener(kind, tier, keys) with kind "stored" or "removed" and the blocks that changed (one
        # call per batch: a store of 64 blocks is one call, not 64), outside the lock.
        self.listeners: list[Callable[[str, str, list[BlockKey]], None]] = []
        # Called as hit_listener(keys) for every recorded hit, outside the lock (kvbm.recency).
        self.hit_listeners: list[Callable[[list[BlockKey]], None]] = []

    # -- key packing ---------------------------------------------------------------------------------
    def _code(self, key: BlockKey) -> int:
        sfx = self._suffix.get(key.namespace)
        if sfx is None:
            sfx = self._intern(key.namespace)
        return int.from_bytes(key.hash + sfx, "little")

    def _peek(self, key: BlockKey) -> int | None:
        """The code of ``key`` for a read, None when its namespace was never registered (reads do not
        intern: a lookup of a stranger's namespace leaves nothing behind)."""
        sfx = self._suffix.get(key.namespace)
        return None if sfx is None else int.from_bytes(key.hash + sfx, "little")

    def _intern(self, namespace: str) -> bytes:
        with self._lock:
            sfx = self._suffix.get(namespace)
            if sfx is None:
                ns = len(self._ns_names)
                if ns > _NS_MASK:
                    raise OverflowError(f"more than {_NS_MASK + 1} namespaces registered")
                sfx = ns.to_bytes(3, "little") + b"\x01"
                self._ns_names.append(namespace)
                self._suffix[namespace] = sfx
            return sfx

    def _key(self, code: int) -> BlockKey:
        n = (code.bit_length() - 1) // 8 - 3
        bits = 8 * n
        return BlockKey(self._ns_names[(code >> bits) & _NS_MASK], (code & ((1 << bits) - 1)).to_bytes(n, "little"))

    def _codes(self, keys: Sequence[BlockKey], intern: bool = True) -> list[int]:
        """The codes of ``keys`` in order, built in C (one pass of maps). Without ``intern`` the list
        stops before the first key of an unknown namespace (nothing of it is held)."""
        names = set(map(_ns_of, keys))
        if len(names) == 1:  # the usual batch: one namespace, so one suffix for every key
            (name,) = names
            sfx = self._suffix.get(name)
            if sfx is None:
                if not intern:
                    return []
                sfx = self._intern(name)
            return list(map(int.from_bytes, map(bytes.__add__, map(_hash_of, keys), repeat(sfx)), repeat("little")))
        if intern:
            return [self._code(k) for k in keys]
        out: list[int] = []
        for k in keys:
            sfx = self._suffix.get(k.namespace)
            if sfx is None:
                break
            out.append(int.from_bytes(k.hash + sfx, "little"))
        return out

    def _canonical(self, code: int) -> int:
        """The int object already stored for ``code`` in any tier (so tiers share it), else ``code``."""
        for d in self._lru:
            c = d.get(code)
            if c is not None:
                return c
        return code

    def _footprint(self, i: int, code: int) -> int:
        odd = self._odd_fp[i]
        if odd:
            fp = odd.get(code)
            if fp is not None:
                return fp
        return self._fp[i] or 0

    def _rebase(self, i: int) -> None:
        """Make the most common footprint of tier ``i`` its base (the first block may have been a partial one),
        so the exceptions dict holds only the rare ones."""
        odd, base, lru = self._odd_fp[i], self._fp[i], self._lru[i]
        counts: dict[int, int] = {}
        for fp in odd.values():
            counts[fp] = counts.get(fp, 0) + 1
        best = max(counts, key=counts.__getitem__)
        if counts[best] > len(lru) - len(odd):
            self._odd_fp[i] = odd = {c: odd.get(c, base) for c in lru if odd.get(c, base) != best}  # type: ignore
            self._fp[i] = best
        self._rebase_at[i] = max(64, 2 * len(odd))

    def _emit(self, kind: str, tier: str, keys: list[BlockKey]) -> None:
        for fn in self.listeners:
            fn(kind, tier, keys)

    # -- membership ------------------------------------------------------------------------------
    def add(self, tier: str, key: BlockKey, footprint: int) -> None:
        i = self._ti[tier]
        code = self._code(key)
        with self._lock:
            new = self._add(i, code, footprint)
        if new and self.listeners:
            self._emit("stored", tier, [key])

    def add_many(self, tier: str, keys: Sequence[BlockKey], footprint: int) -> int:
        """:meth:`add` of a batch of equal-footprint blocks under one lock, heard by listeners as one
        change; returns how many were new in ``tier``."""
        i = self._ti[tier]
        codes = self._codes(keys)
        with self._lock:
            if self._fp[i] == footprint and not self._odd_fp[i]:
                new = self._add_base(i, keys, codes, footprint)
            else:
                new = [k for k, code in zip(keys, codes, strict=True) if self._add(i, code, footprint)]
        if new and self.listeners:
            self._emit("stored", tier, new)
        return len(new)

    def _add_base(self, i: int, keys: Sequence[BlockKey], codes: list[int], footprint: int) -> list[BlockKey]:
        """:meth:`_add` of a batch whose footprint is tier ``i``'s base one (no exceptions to keep), under the
        lock: the common store of equal-size blocks. Returns the keys that were new there."""
        lru = self._lru[i]
        others = [d for j, d in enumerate(self._lru) if j != i and d]  # where a canonical int may already live
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
        self._used[i] += footprint * len(new)  # a re-added block already counted the same base footprint
        return new

    def _add(self, i: int, code: int, footprint: int) -> bool:
        """Insert (or move to the LRU end) ``code`` in tier ``i``, under the lock; whether it was new there."""
        lru = self._lru[i]
        c = lru.pop(code, None)
        new = c is None
        if new:
            c = self._canonical(code)
        else:
            self._used[i] -= self._footprint(i, c)
        lru[c] = c
        base = self._fp[i]
        if base is None:
            self._fp[i] = base = footprint
        odd = self._odd_fp[i]
        if footprint != base:
            odd[c] = footprint
            if len(odd) >= self._rebase_at[i]:
                self._rebase(i)
        elif odd:
            odd.pop(c, None)
        self._used[i] += footprint
        return new

    def remove(self, tier: str, key: BlockKey) -> bool:
        i = self._ti[tier]
        code = self._peek(key)
        with self._lock:
            c = self._lru[i].pop(code, None)
            if c is None:
                return False
            odd = self._odd_fp[i]
            self._used[i] -= (odd.pop(c, None) if odd else None) or self._fp[i] or 0
            if self._hits and not any(code in d for d in self._lru):
                self._hits.pop(code, None)
        if self.listeners:
            self._emit("removed", tier, [key])
        return True

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
        sfx = self._suffix.get(namespace)
        if sfx is None:
            return []
        return self._match(list(map(int.from_bytes, map(bytes.__add__, hashes, repeat(sfx)), repeat("little"))))

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
                for lru in self._lru:
                    c = lru.pop(code, None)
                    if c is not None:
                        lru[c] = c
        for fn in self.hit_listeners:
            fn(keys)

    def hits(self, key: BlockKey) -> int:
        return self._hits.get(self._peek(key), 0)  # type: ignore[arg-type]

    # -- pins ---------------------------------------------------------------------------------------
    def _pin_tier(self, tier: str | None) -> int | None:
        return None if tier is None else self._ti[tier]

    def pin(self, keys: Iterable[BlockKey], tier: str | None = None) -> None:
        """Keep ``keys`` from being evicted from ``tier`` (None: from every tier)."""
        ti = self._pin_tier(tier)
        codes = self._codes(list(keys))
        with self._lock:
            pins = self._pins
            for code in codes:
                p = (ti, code)
                pins[p] = pins.get(p, 0) + 1

    def unpin(self, keys: Iterable[BlockKey], tier: str | None = None) -> None:
        ti = self._pin_tier(tier)
        codes = self._codes(list(keys))
        with self._lock:
            pins = self._pins
            for code in codes:
                p = (ti, code)
                n = pins.get(p, 0) - 1
                if n > 0:
                    pins[p] = n
                else:
                    pins.pop(p, None)

    @contextmanager
    def pinned(self, keys: Sequence[BlockKey], tier: str | None = None) -> Iterator[None]:
        self.pin(keys, tier)
        try:
            yield
        finally:
            self.unpin(keys, tier)

    def is_pinned(self, key: BlockKey, tier: str | None = None) -> bool:
        pins = self._pins
        if not pins:
            return False
        code = self._peek(key)
        return (None, code) in pins or (tier is not None and (self._ti[tier], code) in pins)

    # -- capacity -------------------------------------------------------------------------------------
    def used(self, tier: str) -> int:
        return self._used[self._ti[tier]]

    def count(self, tier: str) -> int:
        return len(self._lru[self._ti[tier]])

    def keys(self, tier: str) -> list[BlockKey]:
        with self._lock:
            codes = list(self._lru[self._ti[tier]])
        return [self._key(c) for c in codes]

    def victims(self, tier: str, need: int, capacity: int) -> list[BlockKey]:
        """Least-recently-used unpinned blocks of ``tier`` whose removal frees room for ``need`` bytes.

        Returns [] when the room is already there; raises LookupError when pinned blocks make it
        impossible.
        """
        i = self._ti[tier]
        with self._lock:
            excess = self._used[i] + need - capacity
            if excess <= 0:
                return []
            out: list[int] = []
            pins = self._pins
            odd = self._odd_fp[i]
            base = self._fp[i] or 0
            for c in self._lru[i]:
                if pins and ((None, c) in pins or (i, c) in pins):
                    continue
                out.append(c)
                excess -= odd.get(c, base) if odd else base
                if excess <= 0:
                    return [self._key(c) for c in out]
            raise LookupError(f"{tier}: not enough unpinned blocks to free {need} bytes")

    def __len__(self) -> int:
        with self._lock:
            lrus = [d for d in self._lru if d]
            if len(lrus) <= 1:
                return len(lrus[0]) if lrus else 0
            seen: set[int] = set()
            for d in lrus:
                seen.update(d)
            return len(seen)
