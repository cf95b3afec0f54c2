"""A block's identity and its bytes: one module per job, the main names re-exported here.

* ``format``: :class:`BlockKey` and the on-storage format (integrity header + payload, checksums).
* ``keys``: the namespace syntax, model slugs, object keys and disk paths.
* ``layout``: :class:`KVLayout` (one model shard) and its fingerprint.
* ``hashing``: chained prefix hashes over token ids; ``vllm_hash``: vLLM's own block hash.
"""

from kvbm.blocks.format import (
    ALIGNED_HEADER_LEN,
    FLAG_PARTIAL,
    FORMAT_VERSION,
    MAGIC,
    MAX_HASH_LEN,
    MIN_HEADER_LEN,
    BlockHeader,
    BlockKey,
    checksum,
    decode_block,
    encode_block,
    encode_block_into,
    pack_header,
    unpack_header,
    verify,
)

__all__ = [
    "ALIGNED_HEADER_LEN", "FLAG_PARTIAL", "FORMAT_VERSION", "MAGIC", "MAX_HASH_LEN", "MIN_HEADER_LEN", "BlockHeader",
    "BlockKey",
    "checksum", "decode_block", "encode_block", "encode_block_into", "pack_header", "unpack_header", "verify",
]
