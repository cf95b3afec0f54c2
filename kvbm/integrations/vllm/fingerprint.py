"""What names the bytes of a vLLM KV cache: dtype, attention backend / CPU ISA, block size, and the layout."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvbm.blocks.layout import DTYPE_BYTES, KVLayout
from kvbm.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvbm.vllm")

# vLLM cache_dtype -> the dtype of the bytes in its KV cache. "fp8" and "fp8_e4m3" are the platform's e4m3
# (float8_e4m3fn, or e4m3fnuz on some ROCm GPUs); "auto" is the model's dtype. Anything else (fp8_inc,
# fp8_ds_mla, per-token-head quantization, turboquant ...) packs scales or a custom layout into the block:
# refused rather than mislabelled.
_CACHE_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float": "float32",
                 "float32": "float32", "fp8_e5m2": "float8_e5m2"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def kv_cache_dtype(vllm_config: VllmConfig) -> str:
    """The kvbm dtype of vLLM's KV cache bytes; ConfigError for a cache dtype kvbm does not know."""
    cd = vllm_config.cache_config.cache_dtype or "auto"
    if cd == "auto":
        name = _dtype_name(vllm_config.model_config.dtype)
    elif cd in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        name = _dtype_name(current_platform.fp8_dtype())
    else:
        name = _CACHE_DTYPES.get(cd, "")
    if name not in DTYPE_BYTES:
        known = ", ".join(["auto", "fp8", "fp8_e4m3", *sorted(_CACHE_DTYPES)])
        raise ConfigError(f"kvbm cannot store vLLM's KV cache with cache_dtype {cd!r} ({name or 'a packed layout'}); "
                          f"use one of: {known}")
    return name


def kv_backend(vllm_config: VllmConfig) -> str:
    """What decides the byte order inside a vLLM block: platform, attention backend (as vLLM selects it),
    the CPU attention ISA (it interleaves K and V per ISA) and the vLLM block size."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    platform = "cpu" if not torch.cuda.is_available() else "cuda"
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(mc.get_head_size(), mc.dtype, cc.cache_dtype,
                                       use_mla=bool(getattr(mc, "use_mla", False))).get_name()
    except Exception as e:  # the engine itself fails to start in this case; name what was configured
        backend = str(getattr(vllm_config.attention_config.backend, "name", None) or "auto")
        log.warning("kvbm: cannot resolve vLLM's attention backend (%s); keying blocks by %r", e, backend)
    parts = ["vllm", platform, backend]
    if backend == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        try:
            parts.append(_get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype))
        except NotImplementedError as e:
            raise ConfigError(f"vLLM's CPU attention cannot run this KV cache: {e}") from None
    parts.append(f"bs{cc.block_size}")
    return "/".join(parts)


def is_mla(vllm_config: VllmConfig) -> bool:
    """Whether the engine caches MLA's joint latent (the same on every TP rank) rather than K and V heads."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def storing_ranks(vllm_config: VllmConfig) -> list[int]:
    """The workers that store (and that a lookup asks): every one, or under MLA TP rank 0 of each stage,
    since the other ranks of its TP group hold the same bytes under the same namespace."""
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    return [s * tp for s in range(pp)] if is_mla(vllm_config) else list(range(pp * tp))


def stage_layers(vllm_config: VllmConfig, pp_rank: int) -> tuple[int, int]:
    """The first layer and the number of layers pipeline stage ``pp_rank`` holds, as vLLM splits them
    (``VLLM_PP_LAYER_PARTITION`` included)."""
    from vllm.distributed.utils import get_pp_indices

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    start, end = get_pp_indices(mc.get_total_num_hidden_layers(), pp_rank, pc.pipeline_parallel_size)
    return start, end - start


def layout_for(vllm_config: VllmConfig, rank: int, block_tokens: int, model_name: str) -> KVLayout:
    """The kvbm layout of one worker's KV cache; its fingerprint keys everything that worker stores.

    ``rank`` is the worker's index in the engine, ``pp_rank * tp_size + tp_rank`` (vLLM's order). Under MLA
    every TP rank holds the same latent KV (one joint "head", not split by TP), so the layout is that of
    the whole TP group: one namespace per stage, whatever the TP rank or size."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    pp_rank, tp_rank = divmod(rank, pc.tensor_parallel_size)
    mla = is_mla(vllm_config)
    first_layer, num_layers = stage_layers(vllm_config, pp_rank)
    revision = mc.revision or getattr(mc.hf_config, "_commit_hash", None) or ""
    dtype = kv_cache_dtype(vllm_config)  # first: a cache dtype kvbm cannot store is refused on any CPU
    return KVLayout(
        model=model_name,
        revision=str(revision),
        backend=kv_backend(vllm_config),
        num_layers=num_layers,
        num_kv_heads=1 if mla else mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=dtype,
        kv_factor=1 if mla else 2,
        tp_rank=0 if mla else tp_rank,
        tp_size=1 if mla else pc.tensor_parallel_size,
        pp_rank=pp_rank,
        pp_size=pc.pipeline_parallel_size,
        first_layer=first_layer,
        tokens_per_block=block_tokens,
        block_bytes=max(1, block_tokens) * 1,  # unused when tokens_per_block is set
    )
