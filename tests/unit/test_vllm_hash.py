"""kvbm's reimplementation of vLLM's block hash."""

import pytest
from needs import import_or_skip

from kvbm.blocks.hashing import prefix_hashes
from kvbm.blocks.vllm_hash import cbor_canonical, none_hash, vllm_block_hashes


@pytest.mark.parametrize(
    "value,hexed",
    [(0, "00"), (23, "17"), (24, "1818"), (1000000, "1a000f4240"), (18446744073709551615, "1bffffffffffffffff"),
     (-1000, "3903e7"), (b"\x01\x02\x03\x04", "4401020304"), ("IETF", "6449455446"), (None, "f6"),
     ((1, (2, 3), [4, 5]), "8301820203820405"), (True, "f5")],
)
def test_cbor_matches_rfc8949_examples(value, hexed):
    assert cbor_canonical(value).hex() == hexed


def test_seed_follows_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = none_hash()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash() != default and none_hash(seed="vllm-none-hash") == default


def test_kvbm_block_spanning_k_vllm_blocks_takes_hash_of_last_one():
    toks = list(range(1000))
    per16 = vllm_block_hashes(toks, 16, seed="x")
    assert len(per16) == 62
    spans = prefix_hashes(toks, 64, scheme="vllm", vllm_block_size=16)
    assert spans == vllm_block_hashes(toks, 16)[3::4]
    with pytest.raises(ValueError, match="multiple"):
        prefix_hashes(toks, 60, scheme="vllm", vllm_block_size=16)


def test_salt_only_changes_everything_through_the_chain():
    toks = list(range(64))
    assert vllm_block_hashes(toks, 16, salt="a")[3] != vllm_block_hashes(toks, 16)[3]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_identical_to_vllms_own_hash_when_vllm_is_installed(algo):
    hashing = import_or_skip("vllm", "vllm.utils.hashing")
    from vllm.v1.core import kv_cache_utils as kcu

    fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    toks = [(i * 7919) % 1000 for i in range(16 * 6 + 5)]
    parent, ref = None, []
    for i in range(6):
        extra = (("lora", "ad", "/p"), ("cache_salt", "s")) if i == 0 else (("lora", "ad", "/p"),)
        parent = kcu.hash_block_tokens(fn, parent, toks[i * 16 : (i + 1) * 16], extra)
        ref.append(bytes(parent))
    assert vllm_block_hashes(toks, 16, salt="s", lora="ad", lora_path="/p", algo=algo) == ref
