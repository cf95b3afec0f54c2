"""What names a chunk of vLLM's native offloading in kvbm: its namespace (the layout) and its block hash.

vLLM's ``TieringOffloadingManager`` keys a chunk by ``OffloadKey`` = the block hash of the chunk's last vLLM
block + its KV-cache group index (4 bytes). kvbm keys a block by namespace + a hash of at most 32 bytes:

* the hash of a group-0 chunk is vLLM's block hash itself (as kvbm's connector keys a kvbm block by the hash
  of its last vLLM block), so ``kvbm keys``/``prewarm`` name it from the tokens; any other group's chunk (or
  a hash longer than 32 bytes) is hashed with its group index (blake2b-256).
* the namespace is the fingerprint of a :class:`KVLayout` whose ``backend`` names everything that decides
  the bytes of a primary-tier chunk row: model, KV dtype, KV-cache groups and their layers, tokens per
  hash, blocks per chunk, bytes per worker and per row (padding included), the exact parallel topology, and
  vLLM's canonical/replicated layout choices. A chunk row is vLLM's host layout, not kvbm's connector's
  (``backend`` starts ``vllm-native/``, never ``vllm/``): the connector and this tier never read each
  other's bytes, even for the same model.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from kvbm.blocks.layout import KVLayout
from kvbm.protocol import MAX_HASH_BYTES

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

BACKEND_PREFIX = "vllm-native/"


def kvbm_hash(key: bytes) -> bytes:
    """The kvbm block hash of vLLM's ``OffloadKey`` ``key`` (block hash + 4-byte big-endian group index)."""
    block_hash, group = key[:-4], int.from_bytes(key[-4:], "big")
    if group == 0 and 1 <= len(block_hash) <= MAX_HASH_BYTES:
        return bytes(block_hash)
    return hashlib.blake2b(b"kvbm-native-group\0" + bytes(key), digest_size=MAX_HASH_BYTES).digest()


def chunk_identity(config: OffloadingConfig, row_bytes: int) -> dict[str, object]:
    """Everything in ``config`` that decides the bytes of one primary-tier chunk row of ``row_bytes``."""
    par = config.parallel
    return {
        "model": config.model.name, "dtype": str(config.model.dtype),
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block, "row_bytes": row_bytes,
        "world_size": par.world_size, "tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size,
        "dcp": par.dcp_size, "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout, "kv_cache_layout": config.kv_cache_layout,
    }


def chunk_tokens(config: OffloadingConfig) -> int:
    """Tokens one chunk of the first KV-cache group covers."""
    per_block = config.groups[0].tokens_per_block if config.groups else config.cache.tokens_per_hash
    return max(1, per_block * config.cache.blocks_per_chunk)


def native_layout(config: OffloadingConfig, row_bytes: int, model_name: str = "") -> KVLayout:
    """The kvbm layout (and so the namespace) of the chunks of ``config``, each a row of ``row_bytes``.

    kvbm stores a row as opaque bytes: one "head" of uint8 per token, ``tokens_per_block`` the chunk's
    tokens, so the layout's block is no bigger than the row; what the bytes mean is the ``backend`` digest."""
    ident = json.dumps(chunk_identity(config, row_bytes), sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()
    tokens = chunk_tokens(config)
    return KVLayout(model=model_name or config.model.name, num_layers=1, num_kv_heads=1,
                    head_size=max(1, row_bytes // tokens), dtype="uint8", kv_factor=1, tokens_per_block=tokens,
                    backend=f"{BACKEND_PREFIX}{digest}")
