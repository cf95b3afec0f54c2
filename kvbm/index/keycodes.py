"""How the registry packs a block into one int: namespace interning and the code of a block key.

code = int.from_bytes(hash || namespace id (3 bytes) || 0x01, "little"): the top byte 0x01 makes the
int's bit length give the hash length back, so the packing is injective for any hash length and up to
2**24 namespaces. A 16-byte hash packs into a 161-bit int (48 bytes of heap, vs 64 for the bytes).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

from kvbm.blocks import BlockKey

_NS_BITS = 24
_NS_MASK = (1 << _NS_BITS) - 1
_hash_of = attrgetter("hash")
_ns_of = attrgetter("namespace")


class KeyCodes:
    """Namespace ids and block codes; namespaces are interned on first write, never on a read."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._suffix: dict[str, bytes] = {}  # namespace -> its 4-byte code suffix
        self._names: list[str] = []  # namespace id -> namespace

    def code(self, key: BlockKey) -> int:
        sfx = self._suffix.get(key.namespace)
        if sfx is None:
            sfx = self._intern(key.namespace)
        return int.from_bytes(key.hash + sfx, "little")

    def peek(self, key: BlockKey) -> int | None:
        """The code of ``key`` for a read, None when its namespace was never registered (reads do not
        intern: a lookup of a stranger's namespace leaves nothing behind)."""
        sfx = self._suffix.get(key.namespace)
        return None if sfx is None else int.from_bytes(key.hash + sfx, "little")

    def _intern(self, namespace: str) -> bytes:
        with self._lock:
            sfx = self._suffix.get(namespace)
            if sfx is None:
                ns = len(self._names)
                if ns > _NS_MASK:
                    raise OverflowError(f"more than {_NS_MASK + 1} namespaces registered")
                sfx = ns.to_bytes(3, "little") + b"\x01"
                self._names.append(namespace)
                self._suffix[namespace] = sfx
            return sfx

    def key(self, code: int) -> BlockKey:
        n = (code.bit_length() - 1) // 8 - 3
        bits = 8 * n
        return BlockKey(self._names[(code >> bits) & _NS_MASK], (code & ((1 << bits) - 1)).to_bytes(n, "little"))

    def codes(self, keys: Sequence[BlockKey], intern: bool = True) -> list[int]:
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
            return [self.code(k) for k in keys]
        out: list[int] = []
        for k in keys:
            sfx = self._suffix.get(k.namespace)
            if sfx is None:
                break
            out.append(int.from_bytes(k.hash + sfx, "little"))
        return out

    def of_hashes(self, namespace: str, hashes: Sequence[bytes]) -> list[int] | None:
        """The codes of one namespace's raw hashes (no BlockKey built); None for a namespace never seen."""
        sfx = self._suffix.get(namespace)
        if sfx is None:
            return None
        return list(map(int.from_bytes, map(bytes.__add__, hashes, repeat(sfx)), repeat("little")))


class Pins:
    """Pin counts per ``(tier index, code)``; tier None pins a block in every tier. Guarded by the
    registry's lock (the caller holds it)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int | None, int], int] = {}

    def add(self, ti: int | None, codes: list[int]) -> None:
        counts = self.counts
        for code in codes:
            p = (ti, code)
            counts[p] = counts.get(p, 0) + 1

    def drop(self, ti: int | None, codes: list[int]) -> None:
        counts = self.counts
        for code in codes:
            p = (ti, code)
            n = counts.get(p, 0) - 1
            if n > 0:
                counts[p] = n
            else:
                counts.pop(p, None)

    def holds(self, ti: int | None, code: int | None) -> bool:
        """Whether ``code`` is pinned in every tier or (``ti`` given) in tier ``ti``."""
        counts = self.counts
        return bool(counts) and ((None, code) in counts or (ti is not None and (ti, code) in counts))
