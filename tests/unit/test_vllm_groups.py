"""vLLM's KV-cache groups as the connector reads them: full attention, MLA and sliding window are stored;
every other kind (Mamba state, chunked local attention, ...) is a clear error at startup, never wrong KV."""

from __future__ import annotations

import pytest
from needs import import_or_skip

from kvbm.errors import ConfigError

import_or_skip("vllm", "vllm", "the vLLM CPU build is not installed (KVBM_EXTRAS=vllm)")


def config(*specs, hash_block_size: int | None = None):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups,
                         **({"hash_block_size": hash_block_size} if hash_block_size else {}))


def attn(kind, **kw):
    import torch

    return kind(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw)


def test_full_attention_and_sliding_window_groups_are_stored():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvbm.integrations.vllm.groups import kv_groups

    g = kv_groups(config(attn(FullAttentionSpec), attn(SlidingWindowSpec, sliding_window=256)), 128)
    assert g.windows == (0, 256) and g.sliding
    assert g.layer_group == {"model.layers.0.attn": 0, "model.layers.1.attn": 1}
    # Blocks 0-5 of 128 tokens lie before token 1,024 - 256 + 1: freed once 1,024 tokens are computed.
    assert not g.intact(5, 128, 1024) and g.intact(6, 128, 1024)
    assert not kv_groups(config(attn(FullAttentionSpec, sliding_window=256)), 128).sliding  # hybrid manager off


def test_a_mamba_group_is_refused_at_startup():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvbm.integrations.vllm.groups import kv_groups

    mamba = MambaSpec(block_size=128, shapes=((4, 8), (8, 16)), dtypes=(torch.bfloat16, torch.bfloat16))
    with pytest.raises(ConfigError, match=r"group 1 \(MambaSpec, layers model.layers.1.attn"):
        kv_groups(config(attn(FullAttentionSpec), mamba), 128)


def test_chunked_local_attention_and_mismatched_block_sizes_are_refused():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    from kvbm.integrations.vllm.groups import kv_groups

    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec"):
        kv_groups(config(attn(ChunkedLocalAttentionSpec, attention_chunk_size=256)), 128)
    with pytest.raises(ConfigError, match="128-token blocks, the engine 64"):
        kv_groups(config(attn(FullAttentionSpec)), 64)
    with pytest.raises(ConfigError, match="hashes 64-token blocks"):
        kv_groups(config(attn(FullAttentionSpec), hash_block_size=64), 128)
