"""The engine's KV-cache groups (vLLM's hybrid KV cache manager): which kvbm can store, and an error for the rest.

A kvbm block holds, for its ``k`` vLLM blocks, the bytes of every layer of every group. Groups share one
block pool, so each layer's bytes sit in the vLLM blocks of its own group: a block transfer lists ``k``
ids per group, group after group. Full-attention (and MLA) groups keep every block of a request; a
sliding-window group frees the blocks that fall out of its window and vLLM gives a hit only the window's
blocks (the rest are its null block): kvbm saves a kvbm block only while all of its blocks are still held,
and loads only the blocks vLLM allocated. Other kinds (Mamba / linear-attention state, chunked local
attention, cross attention, ...) are refused at startup, since kvbm would store or load the wrong bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbm.errors import ConfigError

NULL_BLOCK = 0  # vLLM's null block (the block pool's first): a placeholder holding no request's KV


@dataclass(frozen=True)
class KVGroups:
    """The layer -> group map and each group's sliding window in tokens (0: full attention)."""

    layer_group: dict[str, int]
    windows: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> bool:
        return any(self.windows)

    def intact(self, first_vblock: int, block_size: int, num_computed: int) -> bool:
        """Whether every group still holds the vLLM blocks from ``first_vblock`` on when vLLM has computed
        ``num_computed`` tokens: a sliding-window group frees a block once all its tokens fall before
        ``num_computed - window + 1`` (vLLM's skipped tokens)."""
        return all((first_vblock + 1) * block_size > num_computed - w + 1 for w in self.windows if w)


SINGLE = KVGroups({}, (0,))  # one full-attention group: every layer in group 0


def kv_groups(kv_cache_config: Any, block_size: int) -> KVGroups:
    """The groups of vLLM's ``KVCacheConfig``; ConfigError (at startup) for one kvbm cannot store right."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return SINGLE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    hash_bs = getattr(kv_cache_config, "hash_block_size", None)
    if hash_bs and hash_bs != block_size:
        raise ConfigError(f"kvbm: vLLM hashes {hash_bs}-token blocks but caches {block_size}-token ones "
                          f"(a hybrid model's KV-cache groups): kvbm keys blocks by vLLM's hash of each block")
    layer_group: dict[str, int] = {}
    windows: list[int] = []
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec)
        if kind is SlidingWindowSpec:
            windows.append(int(spec.sliding_window))
        elif kind in (FullAttentionSpec, MLAAttentionSpec):
            windows.append(0)  # a FullAttentionSpec with a window (hybrid manager off) keeps every block
        else:
            raise ConfigError(f"kvbm cannot store vLLM's KV cache group {g} ({kind.__name__}, layers "
                              f"{', '.join(group.layer_names[:4])}...): kvbm stores full-attention, MLA and "
                              f"sliding-window groups only; run this model without KvbmConnector")
        if spec.block_size != block_size:
            raise ConfigError(f"kvbm: vLLM's KV cache group {g} has {spec.block_size}-token blocks, the engine "
                              f"{block_size}: kvbm needs one block size for every group")
        for name in group.layer_names:
            layer_group[name] = g
    return KVGroups(layer_group, tuple(windows))
