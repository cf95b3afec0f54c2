"""kvbm: a tiered KV-cache block manager (G1 GPU -> G2 pinned host -> G3 disk -> G4 S3)."""

from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import HashScheme, prefix_hashes
from kvbm.blocks.layout import KVLayout

__all__ = ["BlockKey", "HashScheme", "KVLayout", "prefix_hashes"]
__version__ = "0.1.0"
