"""The one interface every tier implements."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from kvbm.blocks import BlockKey


def no_observe(*_args: object) -> None:
    """The default latency/copy hook (metrics off); the daemon installs its Prometheus observers instead."""


def no_flags(_key: BlockKey) -> int:
    """The default header flags of a block a tier writes (:data:`kvbm.blocks.format.FLAG_PARTIAL` etc.): none."""
    return 0


class StoredBlock(msgspec.Struct, frozen=True):
    """What a tier knows about a block it holds, without reading its payload."""

    key: BlockKey
    nbytes: int  # payload bytes
    mtime: float = 0.0  # unix seconds of the last write
    footprint: int = 0  # bytes the tier spends on it (slot size, file size, object size)
    partial: bool = False  # its header says it is a partial block (FLAG_PARTIAL; a tier that reads headers)


class TierStats(msgspec.Struct):
    """Counters every tier keeps; the daemon exports them as metrics."""

    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    deletes: int = 0
    errors: int = 0
    shed: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    short_reads: int = 0  # reads that returned another length than the index's: refused, never served


class Tier(abc.ABC):
    """A store of fixed-layout KV blocks addressed by :class:`BlockKey`.

    Payloads are passed as buffer-protocol objects (``memoryview``, ``bytes``, numpy arrays, CPU
    tensors via ``.numpy()``). ``get_into`` writes into a caller-owned buffer so that moves between
    tiers need no intermediate copy. A block that fails its integrity checks is a miss (and is removed
    and counted in ``stats.corrupt``); it is never returned.
    """

    name: str  # "G1", "G2", "G3", "G4"
    kind: str  # "device", "host", "disk", "s3"
    # An existing directory on this node that outlives a restart (the disk tier's): where the manager keeps what must
    # survive one, e.g. the journal of writes owed to S3. None for memory and remote tiers.
    local_dir: Path | None = None
    # Why this tier takes no writes for the rest of this run (a G3 directory the daemon cannot write: its blocks are
    # still served and read to pay what they owe lower tiers); None when it takes them. Writers skip such a tier.
    read_only: str | None = None

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        # The header flags of a block this tier writes (a tier that writes headers asks; the manager answers).
        self.flags_of: Callable[[BlockKey], int] = no_flags

    # -- data path -------------------------------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: BlockKey, data: memoryview | bytes) -> None:
        """Store ``data`` as block ``key`` (replacing any old copy). Raises TierFullError when full."""

    @abc.abstractmethod
    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        """Copy block ``key`` into ``out``; return its length, or None on a miss or a corrupt block."""

    async def get(self, key: BlockKey) -> bytes | None:
        """Block ``key`` as a new bytes object, or None."""
        n = self.nbytes(key)
        if n is None:
            self.stats.misses += 1
            return None
        buf = bytearray(n)
        got = await self.get_into(key, memoryview(buf))
        return None if got is None else bytes(buf[:got])

    @abc.abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Remove block ``key``; True if it was there."""

    async def delete_blocks(self, keys: Sequence[BlockKey], *, gone: bool = False) -> int:
        """Remove many blocks (tiers with a backing store batch it); ``gone``: another process already deleted
        them from the backing store (a purge), so only this tier's index is updated. Returns how many it held."""
        n = 0
        for key in keys:
            n += await self.delete(key)
        return n

    # -- index ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def nbytes(self, key: BlockKey) -> int | None:
        """Payload length of a block this tier holds (from its index, no I/O), else None."""

    def contains(self, key: BlockKey) -> bool:
        return self.nbytes(key) is not None

    @abc.abstractmethod
    def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:
        """Every block this tier holds, or those of one namespace (re-reading its backing store where it
        has one)."""

    @abc.abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Bytes of capacity one block of ``nbytes`` payload consumes in this tier."""

    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Capacity currently consumed."""

    def writable(self) -> bool:
        """False when a write would be refused right now without being tried (e.g. S3's circuit breaker is
        open), so callers can skip reading the source block."""
        return True

    async def refresh(self, namespace: str | None = None) -> None:  # noqa: B027 - optional hook
        """Pick up blocks written to the backing store by another process (no-op for memory tiers)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open resources (re-index, connect). Idempotent."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Stored blocks in persistent tiers survive."""

    def describe(self) -> dict[str, object]:
        return {
            "tier": self.name,
            "kind": self.kind,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes(),
            "stats": msgspec.structs.asdict(self.stats),
            **({"read_only": self.read_only} if self.read_only is not None else {}),
        }


class ReconfirmStats(Protocol):
    reconfirms: int  # entries HEADed again before a durability decision relied on them
    stale: int  # of them, entries the store no longer held (another node deleted them)


@runtime_checkable
class SharedTier(Protocol):
    """A tier other nodes write to as well (the bucket): the index learns and forgets its blocks without I/O,
    and re-checks an entry it has not seen lately before a durability decision relies on it."""

    name: str
    stats: ReconfirmStats

    def footprint(self, nbytes: int) -> int: ...
    def nbytes(self, key: BlockKey) -> int | None: ...
    def remember(self, key: BlockKey, nbytes: int) -> None: ...
    def forget(self, key: BlockKey) -> None: ...
    def seen_within(self, key: BlockKey, max_age_s: float | None = None) -> bool: ...
    async def exists_many(self, keys: Iterable[BlockKey]) -> dict[BlockKey, int | None]: ...
    def list_pages(
        self, list_prefix: str, delimiter: str = "", dirs: list[str] | None = None, start_after: str = ""
    ) -> AsyncIterator[list[tuple[BlockKey | None, str, int, datetime | None]]]:
        """One list of (key or None for a foreign object, object key, size, last-modified) per LIST page under
        the raw key prefix ``list_prefix`` (what the fleet's members and access logs read)."""
        ...
