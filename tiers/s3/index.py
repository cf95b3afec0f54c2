"""What the S3 tier knows of the bucket's blocks without asking it: each block's payload size, the bytes they take,
and when this node last *saw* each object exist (its own PUT, a GET, a HEAD or a listing; monotonic seconds).

A block learned from a peer's event is indexed as hearsay: found by lookups, but not counted as a copy (a durable
ack or a disk eviction) until it is seen or re-checked (:meth:`kvbm.manager.knowledge.IndexSync.real_copies`).
"""

from __future__ import annotations

import time

from kvbm.blocks import BlockKey


class ObjectIndex:
    """Block -> payload bytes, block -> last sighting, and the bytes the indexed blocks take."""

    def __init__(self, header_len: int, copy_max_age_s: float) -> None:
        self.header_len = header_len
        self.copy_max_age_s = copy_max_age_s
        self.sizes: dict[BlockKey, int] = {}
        self.seen: dict[BlockKey, float] = {}
        self.used = 0

    def hearsay(self, key: BlockKey, n: int) -> None:
        """Index a block another node says it wrote (its event) without marking it seen here."""
        old = self.sizes.get(key)
        if old is not None:
            self.used -= old + self.header_len
        self.sizes[key] = n
        self.used += n + self.header_len

    def set(self, key: BlockKey, n: int, seen: float | None = None) -> None:
        """Index ``key`` with ``n`` payload bytes, seen to exist at ``seen`` (monotonic; None: now)."""
        self.hearsay(key, n)
        self.seen[key] = time.monotonic() if seen is None else seen

    def drop(self, key: BlockKey) -> None:
        old = self.sizes.pop(key, None)
        self.seen.pop(key, None)
        if old is not None:
            self.used -= old + self.header_len

    def seen_within(self, key: BlockKey, max_age_s: float | None = None) -> bool:
        """Whether ``key``'s object was seen in the last ``max_age_s`` (default ``s3.copy_max_age_s``): only then
        does it count as a copy without asking the bucket again."""
        t = self.seen.get(key)
        age = self.copy_max_age_s if max_age_s is None else max_age_s
        return t is not None and time.monotonic() - t <= age
