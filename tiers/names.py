"""The tier names, in one place: G1 device, G2 host (the shared slot pool), G3 disk, G4 S3.

A StrEnum, so a name is still the plain string on the wire, in configs and in the registry.
"""

from __future__ import annotations

from enum import StrEnum


class TierName(StrEnum):
    G1 = "G1"  # device memory (GPU)
    G2 = "G2"  # host memory: the slot pool workers share
    G3 = "G3"  # local disk
    G4 = "G4"  # S3 bucket, shared by a fleet


FAST = frozenset({TierName.G1, TierName.G2})  # memory tiers: a block there needs no prefetch or staging
