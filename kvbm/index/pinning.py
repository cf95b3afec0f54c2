"""Pins by key: which blocks are kept from eviction, in one tier or in all (the registry's pin table, split from
:class:`~kvbm.index.registry.Registry`, which shares its lock and its key codes)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from kvbm.blocks import BlockKey
from kvbm.index.keycodes import Pins


class PinTable:
    """Pin counts by key; tier None pins a block in every tier. ``counts`` is read by eviction under the lock."""

    def __init__(self, lock: threading.RLock, tier_index: dict[str, int],
                 codes: Callable[[list[BlockKey]], list[int]], peek: Callable[[BlockKey], int | None]) -> None:
        self._lock = lock
        self._ti = tier_index
        self._codes = codes
        self._peek = peek
        self.pins = Pins()

    def pin(self, keys: Iterable[BlockKey], tier: str | None = None, *, unpin: bool = False) -> None:
        """Keep ``keys`` from being evicted from ``tier`` (None: from every tier); ``unpin``: undo one pin."""
        ti, codes = None if tier is None else self._ti[tier], self._codes(list(keys))
        with self._lock:
            (self.pins.drop if unpin else self.pins.add)(ti, codes)

    def unpin(self, keys: Iterable[BlockKey], tier: str | None = None) -> None:
        self.pin(keys, tier, unpin=True)

    @contextmanager
    def pinned(self, keys: Sequence[BlockKey], tier: str | None = None) -> Iterator[None]:
        self.pin(keys, tier)
        try:
            yield
        finally:
            self.pin(keys, tier, unpin=True)

    def is_pinned(self, key: BlockKey, tier: str | None = None) -> bool:
        return self.pins.holds(None if tier is None else self._ti[tier], self._peek(key))
