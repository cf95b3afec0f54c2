"""Placement policy the manager applies, in one place: which tiers are persistent, which tiers a block
may be written to (the frequency filter), where a copy is read from, and which tiers stage onboards.

Eviction victims: :mod:`kvbm.manager.placement` (by default the registry's least-recently-used unpinned blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.index.registry import Registry
from kvbm.tiers.base import Tier
from kvbm.tiers.names import FAST

PERSISTENT = ("disk", "s3")  # tier kinds that survive a restart


def is_persistent(tier: Tier) -> bool:
    return tier.kind in PERSISTENT


def filtered(tier: Tier, key: BlockKey, registry: Registry, min_hits: int) -> bool:
    """The frequency filter: the disk tier only takes blocks hit at least ``min_hits`` times (as Dynamo does
    for G2->G3, to spare the disk one-off blocks); they still go to S3."""
    return tier.kind == "disk" and registry.hits(key) < min_hits


def below(tiers: Sequence[Tier], name: str) -> list[Tier]:
    """The tiers slower than ``name`` (tiers are ordered fastest first)."""
    i = [t.name for t in tiers].index(name)
    return list(tiers[i + 1 :])


def copy_sources(tiers: Sequence[Tier], registry: Registry, key: BlockKey, dst: str) -> list[str]:
    """Tiers to copy ``key`` from: the nearest above ``dst`` first, then the nearest below."""
    names = [t.name for t in tiers]
    i = names.index(dst)
    order = names[:i][::-1] + names[i + 1 :]
    return [n for n in order if registry.holds(n, key)]


def needs_staging(where: Sequence[str]) -> bool:
    """A block onboarded to the device from disk or S3 is staged through G2 (only memory tiers feed G1)."""
    return bool(where) and where[0] not in FAST
