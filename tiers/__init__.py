"""Storage tiers: G1 device, G2 host, G3 disk, G4 S3. Tiers store and move bytes; the manager decides."""

from kvbm.tiers.base import StoredBlock, Tier, TierStats

__all__ = ["StoredBlock", "Tier", "TierStats"]
