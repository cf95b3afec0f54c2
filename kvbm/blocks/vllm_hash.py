"""vLLM's prefix-cache block hash, computed outside vLLM.

vLLM (v1, 0.32) hashes block ``i`` as ``H((parent, tuple(token_ids), extra_keys))`` where ``H`` is
``prefix_caching_hash_algo``: ``sha256`` (the default: SHA-256 of the tuple pickled with the highest
protocol) or ``sha256_cbor`` (SHA-256 of its canonical CBOR encoding). The first block's parent is
``NONE_HASH = H(seed)``, the seed being ``$PYTHONHASHSEED`` if set, else the fixed string
``"vllm-none-hash"``. ``extra_keys`` is None, or a tuple of ``("lora", name, path)`` and, for the
first block only, ``("cache_salt", salt)``. Multimodal and prompt-embedding keys are not supported
here (kvbm takes those hashes from vLLM itself through the connector).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError("integer too large for CBOR")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) for None, bool, int, bytes, str, tuple and list."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, (bytes, bytearray)):
        return _cbor_head(2, len(obj)) + bytes(obj)
    if isinstance(obj, str):
        b = obj.encode()
        return _cbor_head(3, len(b)) + b
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor_canonical(obj)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return HASH_FUNCTIONS[algo](seed)


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    salt: str | None = None,
    lora: str | None = None,
    lora_path: str | None = None,
    algo: str = "sha256",
    seed: str | None = None,
) -> list[bytes]:
    """vLLM's hash of every full ``block_size``-token block of ``tokens``."""
    if algo not in HASH_FUNCTIONS:
        raise ValueError(f"unsupported vLLM hash algorithm {algo!r}; use one of {sorted(HASH_FUNCTIONS)}")
    fn = HASH_FUNCTIONS[algo]
    parent = none_hash(algo, seed)
    toks = [int(t) for t in tokens]
    out: list[bytes] = []
    for i in range(len(toks) // block_size):
        extra: list[Any] = []
        if lora:
            extra.append(("lora", lora, lora_path or ""))
        if i == 0 and salt:
            extra.append(("cache_salt", salt))
        parent = fn((parent, tuple(toks[i * block_size : (i + 1) * block_size]), tuple(extra) if extra else None))
        out.append(parent)
    return out
