"""The connector's layout from a real vLLM config: the fingerprint names the bytes (cache dtype, backend /
CPU ISA, block size, revision), unknown cache dtypes are refused, any model name gives a valid namespace."""

from __future__ import annotations

import pytest
from needs import import_or_skip

from kvbm.blocks.keys import check_namespace
from kvbm.errors import ConfigError

import_or_skip("vllm", "vllm", "the vLLM CPU build is not installed (KVBM_EXTRAS=vllm)")


def vllm_config(model: str, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=4096, **kw).create_engine_config()


def layout(model: str, name: str = "tiny", **kw):
    from kvbm.integrations.vllm import layout_for

    cfg = vllm_config(model, **kw)
    return layout_for(cfg, 0, cfg.cache_config.block_size, name)


def test_cache_dtype_is_fingerprinted(tiny_model):
    auto = layout(tiny_model)
    assert auto.dtype == "bfloat16"  # the model's dtype
    assert layout(tiny_model, kv_cache_dtype="bfloat16").namespace == auto.namespace
    f16 = layout(tiny_model, kv_cache_dtype="float16")
    assert f16.dtype == "float16" and f16.namespace != auto.namespace
    from kvbm.bench.openai_server import avx2_only_cpu

    if avx2_only_cpu():
        # An AVX2-only CPU: vLLM cannot run an fp8 cache here, and the layout says so (the engine would not
        # start either) instead of keying blocks by a byte order that does not exist.
        for cd in ("fp8", "fp8_e5m2"):
            with pytest.raises(ConfigError, match="vLLM's CPU attention cannot run this KV cache: FP8"):
                layout(tiny_model, kv_cache_dtype=cd)
        return
    e4m3 = layout(tiny_model, kv_cache_dtype="fp8")
    assert e4m3.dtype == "float8_e4m3fn" and e4m3.bytes_per_token * 2 == auto.bytes_per_token
    assert layout(tiny_model, kv_cache_dtype="fp8_e4m3").namespace == e4m3.namespace  # fp8 means e4m3
    e5m2 = layout(tiny_model, kv_cache_dtype="fp8_e5m2")
    assert e5m2.dtype == "float8_e5m2"
    assert len({auto.namespace, e4m3.namespace, e5m2.namespace}) == 3


@pytest.mark.parametrize("cache_dtype", ["fp8_inc", "fp8_ds_mla", "int8_per_token_head"])
def test_unknown_cache_dtype_is_refused(tiny_model, cache_dtype):
    with pytest.raises(ConfigError, match=f"cache_dtype '{cache_dtype}'"):
        layout(tiny_model, kv_cache_dtype=cache_dtype)


def test_backend_block_size_and_revision_are_fingerprinted(tiny_model):
    base = layout(tiny_model, block_size=16)
    assert base.backend.startswith("vllm/cpu/CPU_ATTN/") and base.backend.endswith("/bs16")
    assert len(base.backend.split("/")) == 5  # the CPU attention ISA is part of it
    # Two vLLM blocks of 16 or one of 32: the same kvbm block size, different bytes.
    from kvbm.integrations.vllm import layout_for

    cfg32 = vllm_config(tiny_model, block_size=32)
    assert layout_for(cfg32, 0, 32, "tiny").namespace != layout_for(vllm_config(tiny_model, block_size=16), 0, 32,
                                                                      "tiny").namespace
    r1 = layout(tiny_model, block_size=16, revision="r1")
    assert r1.revision == "r1" and r1.namespace != base.namespace
    assert layout(tiny_model, block_size=16, revision="r2").namespace != r1.namespace


@pytest.mark.parametrize("name", ["./m", "/abs/path/Model", "..", "модель"])
def test_any_model_name_gives_a_valid_namespace(tiny_model, name):
    lay = layout(tiny_model, name=name)
    assert check_namespace(lay.namespace) == lay.namespace


def test_each_pipeline_stage_has_its_own_namespace(tiny_model):
    """PP=2 splits the tiny model's 2 layers one per stage: the stages hold different layers of the same
    tokens, so their namespaces differ; a PP=1 layout keeps the namespace it had before stages were named."""
    from kvbm.integrations.vllm import layout_for

    cfg = vllm_config(tiny_model, pipeline_parallel_size=2, distributed_executor_backend="mp")
    bs = cfg.cache_config.block_size
    s0, s1 = layout_for(cfg, 0, bs, "tiny"), layout_for(cfg, 1, bs, "tiny")
    assert (s0.pp_rank, s0.first_layer, s0.num_layers) == (0, 0, 1)
    assert (s1.pp_rank, s1.first_layer, s1.num_layers) == (1, 1, 1)
    assert s0.tp_rank == s1.tp_rank == 0 and s0.block_nbytes == s1.block_nbytes
    assert s0.namespace != s1.namespace
    assert layout(tiny_model).namespace == "tiny-" + _v2_fingerprint(layout(tiny_model))


def _v2_fingerprint(lay) -> str:
    """The fingerprint as kvbm computed it before pipeline stages were part of it."""
    import hashlib
    import json

    ident = json.dumps(["kvbm-layout-v2", lay.model, lay.revision, lay.num_layers, lay.num_kv_heads, lay.head_size,
                        lay.dtype, lay.kv_factor, lay.tp_rank, lay.tp_size, lay.block_tokens, lay.backend])
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()
