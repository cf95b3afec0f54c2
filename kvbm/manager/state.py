"""The narrow state the block manager's parts share (room, moves, cascade, external stores, index sync, owed).

Each part is handed this one object and the callables it needs, never the manager itself: build order stops
mattering, no part imports the manager, and each part can be tested alone with a state of fake tiers. Parts
read ``state.registry`` per call, so a registry swapped in later (the manager bench does) reaches all of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from kvbm.blocks import FLAG_PARTIAL, BlockKey
from kvbm.index.registry import Registry
from kvbm.manager import policy
from kvbm.manager.failures import FailureLog
from kvbm.tiers.base import Tier, no_observe
from kvbm.transfer.memory import MemoryMover

CopyObserver = Callable[[str, str, float], None]  # (source tier, destination tier, seconds) per block copy
Move = Callable[[BlockKey, str], Awaitable[bool]]  # copy a block into a tier (kvbm.manager.moves.Moves.move)
# Of some keys, those a tier is known to really hold (kvbm.manager.knowledge.IndexSync.real_copies)
RealCopies = Callable[[str, Sequence[BlockKey]], Awaitable[set[BlockKey]]]


class ManagerStats(msgspec.Struct):
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    onboards: int = 0
    onboard_blocks: int = 0
    onboard_seconds: float = 0.0
    offloads: int = 0
    offload_blocks: int = 0
    cascade_writes: int = 0
    cascade_failures: int = 0
    shed_offloads: int = 0
    evictions: int = 0
    demotions: int = 0
    demotion_failures: int = 0
    kept: int = 0  # evictions refused: a persistent tier's block no lower tier could take
    dropped: int = 0  # memory-tier blocks evicted although no lower tier could take them
    filtered: int = 0
    catch_up_writes: int = 0  # owed write-throughs retried once their tier took writes again
    owed_paid: int = 0  # owed write-throughs that reached their tier
    owed_dropped: int = 0  # write-throughs not owed: s3.max_owed_blocks were owed already
    owed_resumed: int = 0  # owed write-throughs read back from the journal at start (a restart after an outage)
    owed_reconciled: int = 0  # blocks on disk the bucket's first listing lacked, owed to it (kvbm.manager.owed)
    partial_evictions: int = 0  # evictions of partial blocks (those never hit go first: kvbm.index.partials)
    partials_superseded: int = 0  # partial blocks dropped from every tier: their full block was stored
    partials_kept: int = 0  # superseded partial blocks left in place: a worker was reading them
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # "G3:ValueError" -> count


@dataclass
class ManagerState:
    """Tier order, the index, counters, failures, the memory mover, the copy hook and the admission filter."""

    tiers: list[Tier]
    registry: Registry
    stats: ManagerStats = field(default_factory=ManagerStats)
    mover: MemoryMover | None = None
    min_hits_to_offload: int = 0
    observe_copy: CopyObserver = no_observe
    placement: Any = None  # kvbm.manager.placement.PlacementPolicy (None: LRU, the registry's own order)
    failures: FailureLog = field(init=False)
    by_name: dict[str, Tier] = field(init=False)
    off: dict[str, str] = field(default_factory=dict)  # tiers turned off at start (kvbm.manager.tiers_off) -> why

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tiers}
        self.failures = FailureLog(self.stats.errors)
        for t in self.tiers:  # a tier that writes headers records a partial block as one (a restart knows it)
            t.flags_of = self.flags_of

    def flags_of(self, key: BlockKey) -> int:
        """The header flags of block ``key`` as the registry knows it (read per call: a registry swapped in)."""
        return FLAG_PARTIAL if self.registry.is_partial(key) else 0

    def turn_off(self, tier: Tier, why: str) -> None:
        """Take ``tier`` out of the tier order (before serving: nothing of it is indexed yet)."""
        self.tiers = [t for t in self.tiers if t is not tier]
        self.by_name.pop(tier.name, None)
        self.off[tier.name] = why

    def below(self, name: str) -> list[Tier]:
        """The tiers below tier ``name``, fastest first."""
        return policy.below(self.tiers, name)

    def victims(self, tier: str, need: int, capacity: int) -> list[BlockKey]:
        """Blocks to evict from ``tier`` for ``need`` bytes, as the placement policy orders them."""
        if self.placement is None:
            return self.registry.victims(tier, need, capacity)
        return self.placement.victims(tier, need, capacity)

    def filtered(self, tier: Tier, key: BlockKey) -> bool:
        """The frequency filter (:func:`kvbm.manager.policy.filtered`) with ``min_hits_to_offload``."""
        return policy.filtered(tier, key, self.registry, self.min_hits_to_offload)


T = TypeVar("T")


class StateField(Generic[T]):
    """An attribute of the owner that is the same-named field of its ``state`` (read and set through)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        return getattr(obj.state, self.name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj.state, self.name, value)
