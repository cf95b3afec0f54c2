"""Chained prefix hashes over full blocks of token ids.

Block ``i``'s hash covers every token up to the end of block ``i``: it is computed from the parent
block's hash and block ``i``'s tokens, so equal hashes mean equal prefixes. Only full blocks are hashed;
a partial trailing block never gets a hash and so is never stored.

Two schemes:

* ``kvbm`` (default): BLAKE2b-128 over ``parent || tokens as little-endian uint32``; the root parent is
  derived from the optional salt and LoRA name, each length-prefixed. It is cryptographic (a tenant
  cannot craft a collision to poison another's cache), identical in every process and release, and
  costs ~1 us per block.
* ``vllm``: vLLM's own prefix-cache hash (``sha256_cbor``), so that a kvbm block spanning ``k`` vLLM
  blocks is keyed by vLLM's hash of its last vLLM block and kvbm agrees with vLLM's KV events. See
  :mod:`kvbm.blocks.vllm_hash`.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence

import numpy as np

ROOT_TAG = b"kvbm-prefix-v2"


class HashScheme(str, enum.Enum):
    KVBM = "kvbm"
    VLLM = "vllm"


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def root_hash(salt: str | None = None, lora: str | None = None) -> bytes:
    """The parent hash of the first block of a sequence.

    Each field is length-prefixed, so no salt and LoRA name pair can encode like another pair."""
    h = hashlib.blake2b(ROOT_TAG, digest_size=16)
    for value in (salt or "", lora or ""):
        raw = value.encode()
        h.update(struct.pack("<Q", len(raw)) + raw)
    return h.digest()


def chain_hash(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The kvbm hash of one block given its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(_token_bytes(tokens))
    return h.digest()


def prefix_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    *,
    salt: str | None = None,
    lora: str | None = None,
    scheme: HashScheme | str = HashScheme.KVBM,
    vllm_block_size: int | None = None,
) -> list[bytes]:
    """Hashes of every full block of ``tokens``, in order.

    With ``scheme="vllm"``, ``block_tokens`` must be a multiple of ``vllm_block_size``; each kvbm block's
    hash is vLLM's hash of the last vLLM block inside it.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    scheme = HashScheme(scheme)
    n_full = len(tokens) // block_tokens
    if scheme is HashScheme.VLLM:
        from kvbm.blocks.vllm_hash import vllm_block_hashes

        vbs = vllm_block_size or block_tokens
        if block_tokens % vbs:
            raise ValueError(f"kvbm block of {block_tokens} tokens is not a multiple of vLLM's {vbs}")
        k = block_tokens // vbs
        per_vllm = vllm_block_hashes(list(tokens[: n_full * block_tokens]), vbs, salt=salt, lora=lora)
        return per_vllm[k - 1 :: k]
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[bytes] = []
    parent = root_hash(salt, lora)
    for i in range(n_full):
        parent = chain_hash(parent, arr[i * block_tokens : (i + 1) * block_tokens])
        out.append(parent)
    return out
