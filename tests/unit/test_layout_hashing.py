"""Layout arithmetic, fingerprints and prefix-hash determinism."""

import subprocess
import sys

import pytest

from kvbm.blocks.hashing import prefix_hashes, root_hash
from kvbm.blocks.layout import KVLayout
from kvbm.errors import ConfigError


def llama8b(**kw):
    args = {"model": "meta-llama/Llama-3.1-8B", "num_layers": 32, "num_kv_heads": 8, "head_size": 128, **kw}
    return KVLayout(**args)


def test_llama_8b_bf16_is_128k_per_token_and_64_tokens_per_8mib_block():
    lay = llama8b()
    assert lay.bytes_per_token == 128 * 1024
    assert lay.block_tokens == 64
    assert lay.block_nbytes == 8 * 1024 * 1024


def test_tensor_parallel_splits_kv_heads_and_replicates_when_fewer_heads_than_ranks():
    assert llama8b(tp_size=2, tp_rank=1).bytes_per_token == 64 * 1024
    assert llama8b(tp_size=2).block_tokens == 128
    # 8 KV heads on 16 ranks: each rank still holds one head.
    assert llama8b(tp_size=16, tp_rank=3).kv_heads_per_rank == 1


def test_mla_uses_one_latent_and_explicit_tokens_per_block_wins():
    mla = KVLayout(model="ds", num_layers=61, num_kv_heads=1, head_size=576, kv_factor=1, dtype="bfloat16")
    assert mla.bytes_per_token == 61 * 576 * 2
    lay = llama8b(tokens_per_block=16)
    assert lay.block_tokens == 16 and lay.block_nbytes == 16 * 128 * 1024


def test_fingerprint_separates_models_dtypes_and_tp_shapes():
    prints = {
        llama8b().fingerprint,
        llama8b(dtype="float16").fingerprint,
        llama8b(tp_size=2).fingerprint,
        llama8b(tp_size=2, tp_rank=1).fingerprint,
        KVLayout(model="other", num_layers=32, num_kv_heads=8, head_size=128).fingerprint,
        # Pipeline stages of one model: same shape, different layers.
        llama8b(num_layers=16, pp_size=2).fingerprint,
        llama8b(num_layers=16, pp_size=2, pp_rank=1, first_layer=16).fingerprint,
        llama8b(num_layers=16).fingerprint,
    }
    assert len(prints) == 8
    assert llama8b().fingerprint == llama8b().fingerprint
    assert llama8b().namespace.endswith(llama8b().fingerprint)
    assert llama8b().namespace.startswith("meta-llama-llama-3.1-8b-")


@pytest.mark.parametrize(
    "kw,field",
    [({"num_layers": 0}, "num_layers"), ({"dtype": "float64"}, "dtype"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
     ({"pp_rank": 1}, "pp_rank"), ({"first_layer": -1}, "first_layer"),
     ({"kv_factor": 3}, "kv_factor"), ({"block_bytes": 10}, "block_bytes")],
)
def test_bad_layout_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        llama8b(**kw)


def test_only_full_blocks_are_hashed_and_hashes_chain():
    toks = list(range(1000))
    hs = prefix_hashes(toks, 64)
    assert len(hs) == 1000 // 64
    # Same prefix, different tail: shared leading hashes, then divergence.
    other = toks[:640] + [7] * 360
    hs2 = prefix_hashes(other, 64)
    assert hs2[:10] == hs[:10] and hs2[10] != hs[10]
    # A change in block 0 changes every later hash (chaining).
    hs3 = prefix_hashes([1, *toks[1:]], 64)
    assert all(a != b for a, b in zip(hs, hs3, strict=True))
    assert prefix_hashes(toks[:63], 64) == []


def test_salt_and_lora_change_identity():
    toks = list(range(128))
    base = prefix_hashes(toks, 64)
    assert prefix_hashes(toks, 64, salt="tenant-a") != base
    assert prefix_hashes(toks, 64, lora="adapter") != base
    assert root_hash("a", None) != root_hash(None, "a")


def test_hashes_are_identical_across_processes_with_different_hash_seeds():
    code = ("from kvbm.blocks.hashing import prefix_hashes; "
            "print([h.hex() for h in prefix_hashes(list(range(300)), 32)])")
    outs = set()
    for seed in ("0", "12345", "random"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
    assert eval(outs.pop()) == [h.hex() for h in prefix_hashes(list(range(300)), 32)]


def test_token_ids_must_fit_uint32():
    with pytest.raises(ValueError):
        prefix_hashes([-1] * 64, 64)
