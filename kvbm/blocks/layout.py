"""KV layout of one model shard: sizes per token and per block, and the layout fingerprint."""

from __future__ import annotations

import hashlib
import json

import msgspec

from kvbm.blocks.keys import make_namespace
from kvbm.errors import ConfigError

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

DEFAULT_BLOCK_BYTES = 8 * 1024 * 1024


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of the KV cache that one worker (a tensor-parallel rank of one pipeline stage) holds.

    ``num_kv_heads`` is the model's total; a rank holds ``kv_heads_per_rank`` of them (heads are
    replicated when there are fewer heads than ranks). ``kv_factor`` is 2 for separate K and V,
    1 for MLA's joint latent. ``tokens_per_block`` of 0 means "derive from ``block_bytes``".
    A pipeline stage holds ``num_layers`` layers from ``first_layer`` on: stage ``pp_rank`` of ``pp_size``.
    ``backend`` names how the engine lays the bytes out inside a block where that varies (attention
    backend, CPU ISA); ``revision`` is the model revision when known. Both go into the fingerprint.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kv_factor: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    tokens_per_block: int = 0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    backend: str = ""
    revision: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_size", "pp_size", "block_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"layout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"layout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.kv_factor not in (1, 2):
            raise ConfigError(f"layout.kv_factor must be 1 (MLA) or 2 (K and V), got {self.kv_factor}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"layout.tp_rank {self.tp_rank} is outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"layout.pp_rank {self.pp_rank} is outside [0, {self.pp_size})")
        if self.first_layer < 0:
            raise ConfigError(f"layout.first_layer must be >= 0, got {self.first_layer}")
        if self.tokens_per_block < 0:
            raise ConfigError("layout.tokens_per_block must be >= 0 (0 derives it from block_bytes)")
        if self.tokens_per_block == 0 and self.block_bytes < self.bytes_per_token:
            raise ConfigError(
                f"layout.block_bytes {self.block_bytes} is smaller than one token ({self.bytes_per_token} B)"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.kv_heads_per_rank * self.head_size * self.dtype_bytes * self.kv_factor

    @property
    def block_tokens(self) -> int:
        """Tokens in one full block: explicit, or as many as fit in ``block_bytes``."""
        if self.tokens_per_block:
            return self.tokens_per_block
        return self.block_bytes // self.bytes_per_token

    @property
    def block_nbytes(self) -> int:
        """Exact payload size of one full block."""
        return self.block_tokens * self.bytes_per_token

    @property
    def fingerprint(self) -> str:
        """16 hex chars naming everything that makes two blocks' bytes incompatible.

        The fields are JSON-encoded, so no value (a model name with ``|`` in it) can run into the next. The
        pipeline stage (and the layers it holds) is there only under pipeline parallelism, so a PP=1 layout
        keeps the namespace it always had, and no PP stage reads what an engine stored before stages were
        named (all stages then shared one namespace)."""
        fields: list[object] = [
            "kvbm-layout-v2", self.model, self.revision, self.num_layers, self.num_kv_heads, self.head_size,
            self.dtype, self.kv_factor, self.tp_rank, self.tp_size, self.block_tokens, self.backend,
        ]
        if self.pp_size > 1 or self.first_layer:
            fields += ["pp", self.pp_rank, self.pp_size, self.first_layer]
        ident = json.dumps(fields)
        return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()

    @property
    def namespace(self) -> str:
        """Storage namespace: a readable model slug plus the fingerprint (syntax: :mod:`kvbm.blocks.keys`)."""
        return make_namespace(self.model, self.fingerprint)
