"""Preemption under KV-cache pressure through a real vLLM (CPU build) and a real daemon: every block kvbm
stored for a preempted request holds the KV of its own tokens.

vLLM preempts requests when its KV cache runs out and, when it resumes one, lists the request's whole block
list again (``resumed_req_ids``). The connector used to append that list to the one it had, so blocks filled
after the resume were saved from the request's early vLLM blocks, under the later blocks' hashes: a later
turn that re-sends the answer would load the wrong KV, with no error.

The oracle is an engine under no pressure computing each request's tokens (prompt and answer) as a prompt:
its stored blocks are the KV those tokens have. A block is the same when its values agree to within the
numerical noise of batching (a block from another position differs by the size of the values themselves).
"""

from __future__ import annotations

import importlib.util
import json

import msgspec
import numpy as np
import pytest
import torch
from needs import needs
from test_vllm_e2e import HASH_SEED, VLLM_BS, run_vllm
from test_vllm_layouts import g2_daemon

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.blocks.vllm_hash import vllm_block_hashes

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]
K = 2  # 128 KiB daemon blocks / 64 KiB vLLM blocks of the tiny model
BLOCK_TOKENS = K * VLLM_BS


def stored_blocks(daemon, layout: KVLayout, tokens: list[int]) -> list[np.ndarray | None]:
    """The bytes the daemon holds for each full kvbm block of ``tokens`` (None: not stored)."""
    full = (len(tokens) - 1) // BLOCK_TOKENS  # the last token is sampled, never computed
    hashes = vllm_block_hashes(tokens, VLLM_BS, seed=HASH_SEED)[K - 1 :: K][:full]
    out: list[np.ndarray | None] = []
    with daemon.client(timeout_s=10) as c:
        c.register(layout, worker_id="preemption-reader")
        for h in hashes:
            buf = np.zeros(c.registered.slot_bytes, np.uint8)
            got = c.load([BlockKey(layout.namespace, h)], [buf])
            out.append(buf if got == 1 else None)
    return out


def relative_error(a: np.ndarray, b: np.ndarray, dtype: str) -> float:
    ta = torch.from_numpy(a).view(getattr(torch, dtype)).float()
    tb = torch.from_numpy(b).view(getattr(torch, dtype)).float()
    return float((ta - tb).norm() / tb.norm().clamp_min(1e-12))


def test_blocks_saved_across_preemption_hold_their_own_tokens_kv(tmp_path, tiny_model, monkeypatch):
    prompts = [[(i * (7 + 2 * r) + 11 * r) % 991 + 3 for i in range(500)] for r in range(6)]
    answer = 270  # 770 tokens a request: 3 full kvbm blocks, the last one made of answer tokens only
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    monkeypatch.setenv("KVBM_HOOK_TIMES_DIR", str(hooks))  # the engine's connector writes its hook times here
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pressure, clean = g2_daemon(tmp_path / "a"), g2_daemon(tmp_path / "b")
    try:
        pressure.start()
        clean.start()
        # 6 requests of up to 7 vLLM blocks each over a KV cache of 14: vLLM preempts and resumes.
        (run,) = run_vllm(tmp_path, "pressure", tiny_model, pressure, [{"batch": prompts, "max_tokens": answer}],
                          engine={"num_gpu_blocks_override": 14, "max_model_len": 1024, "max_num_seqs": 6})
        assert len(run["preempted"]) > 0, "no request was preempted: the test did not take the path it tests"
        # Every hook's time is in the histograms, preemption fences included (one file per side and process).
        sides = {f.name.split("-")[0]: json.loads(f.read_text()) for f in hooks.glob("*.json")}
        assert set(sides) == {"scheduler", "worker"}, sorted(hooks.iterdir())
        assert sides["worker"]["hooks"]["handle_preemptions"]["count"] > 0
        assert sides["scheduler"]["step"]["count"] > 0 and sides["worker"]["step"]["count"] > 0
        assert sum(sides["scheduler"]["hooks"]["build_connector_meta"]["buckets"]) == \
            sides["scheduler"]["hooks"]["build_connector_meta"]["count"]
        texts = [p + out for p, out in zip(prompts, run["batch_tokens"], strict=True)]
        assert all(len(t) == 500 + answer for t in texts)
        # The reference: each request's tokens computed as one prompt, with nothing else running.
        run_vllm(tmp_path, "clean", tiny_model, clean,
                 [{"prompt": t, "max_tokens": 1, "settle": True} for t in texts])
        layout = msgspec.json.decode(run["layouts"][0], type=KVLayout)
        verdict = []
        for r, t in enumerate(texts):
            got, want = stored_blocks(pressure, layout, t), stored_blocks(clean, layout, t)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert w is not None, f"the clean engine did not store request {r}'s block {i}"
                err = None if g is None else relative_error(g, w, layout.dtype)
                verdict.append((r, i, err))
        print("per block (request, block, relative error vs the clean engine; None: not stored):", verdict)
        wrong = [v for v in verdict if v[2] is not None and v[2] > 0.02]
        assert not wrong, f"blocks stored with another block's KV: {wrong}"
        missing = [v for v in verdict if v[2] is None]
        assert not missing, f"full blocks of preempted requests never stored: {missing}"
    finally:
        pressure.stop()
        clean.stop()


def test_a_request_whose_load_came_up_short_saves_the_blocks_it_then_computed(tmp_path, tiny_model):
    """A load that comes up short (its later blocks evicted between lookup and load): vLLM recomputes them,
    and those recomputed blocks are saved again (they used to count as saved, being "loaded", and were never
    stored: the next engine missed them). What the step computed on top of the missing blocks is not saved.
    The next load (one engine throughout: its prefix cache reset and its KV caches poisoned before each step)
    brings every block, with the bytes the first step computed."""
    prompt = [(i * 23 + 9) % 977 + 3 for i in range(1100)]
    full = (len(prompt) - 1) // BLOCK_TOKENS  # 4 kvbm blocks
    first, short, last = _short_load(tmp_path, tiny_model, "short", prompt, digest_blocks=full * K,
                                     evict_before_load=1)
    assert short["evicted_before_load"] == full - 1, short
    assert short["tokens"] == first["tokens"]
    assert last["num_cached_tokens"] == full * BLOCK_TOKENS, "the recomputed blocks were not saved again"
    assert last["kv_digests"] == first["kv_digests"]
    assert last["tokens"] == first["tokens"]


def _short_load(tmp_path, model: str, name: str, prompt: list[int], **kw) -> list[dict]:
    """One engine, one G2 daemon: the prompt stored, then loaded with its blocks evicted between lookup and load
    (``kw``: :func:`run_vllm`'s), then loaded whole; each with vLLM's cache reset and its KV caches poisoned."""
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        return run_vllm(
            tmp_path, name, model, daemon,
            [{"settle": True}, {"settle": True, "poison": True}, {"poison": True, "evict_before_load": False}],
            prompt=prompt, **kw)
    finally:
        daemon.stop()


def test_a_request_whose_partial_block_did_not_load_saves_it_again(tmp_path, tiny_model):
    """A load whose partial block was gone by the load (evicted first between lookup and load): vLLM recomputes
    its vLLM blocks, but the request remembered the partial block as loaded and never saved it again, so every
    later hit stopped at the full blocks. Now it is saved again once recomputed, and the next load brings it."""
    prompt = [(i * 23 + 9) % 977 + 3 for i in range(1200)]
    full = (len(prompt) - 1) // BLOCK_TOKENS  # 4 kvbm blocks, and a partial block of one vLLM block
    first, short, last = _short_load(tmp_path, tiny_model, "partial-short", prompt, evict_before_load=full,
                                     evict_partial=True)
    assert first["kv_transfer_params"]["kvbm"]["degraded"] is False
    assert short["evicted_before_load"] >= 1, short
    assert short["tokens"] == first["tokens"]
    was, now = short["kv_transfer_params"]["kvbm"], last["kv_transfer_params"]["kvbm"]  # the engine's totals
    assert was["partial_saves"] == 2, was  # the first run's, and the short one's again
    assert last["num_cached_tokens"] == full * BLOCK_TOKENS + VLLM_BS, "the partial block was not saved again"
    assert now["hit_partial_vblocks"] - was["hit_partial_vblocks"] == 1, (was, now)
    assert last["tokens"] == first["tokens"]


def test_a_short_sync_load_never_makes_another_request_store_what_did_not_load(tmp_path, tiny_model):
    """Two requests with one stored prefix admitted in one step; the first one's sync load comes up short
    (its blocks evicted between lookup and load). vLLM caches the first one's blocks when it allocates them,
    so the second one hits them in vLLM's own prefix cache and computes on top of blocks that never loaded.
    Its saves of those blocks used to go through (only the failed request's were dropped) and the daemon
    stored the garbage under the right hashes, for good. Every block kvbm holds afterwards must be the KV a
    clean engine computes for its tokens."""
    prefix = [(i * 29 + 5) % 983 + 3 for i in range(1100)]
    texts_in = [prefix + [(i * 3 + r) % 900 + 3 for i in range(40)] for r in range(2)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    daemon, clean = g2_daemon(tmp_path / "a"), g2_daemon(tmp_path / "b")
    try:
        daemon.start()
        clean.start()
        _stored, run = run_vllm(tmp_path, "short", tiny_model, daemon,
                               [{"settle": True}, {"batch": texts_in, "max_tokens": 4, "poison": True}],
                               prompt=prefix, evict_before_load=1)
        assert run["layouts"], run
        texts = [p + out for p, out in zip(texts_in, run["batch_tokens"], strict=True)]
        run_vllm(tmp_path, "clean", tiny_model, clean, [{"prompt": t, "max_tokens": 1, "settle": True} for t in texts])
        layout = msgspec.json.decode(run["layouts"][0], type=KVLayout)
        verdict = []
        for r, t in enumerate(texts):
            got, want = stored_blocks(daemon, layout, t), stored_blocks(clean, layout, t)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert w is not None, f"the clean engine did not store request {r}'s block {i}"
                verdict.append((r, i, None if g is None else relative_error(g, w, layout.dtype)))
        print("per block (request, block, relative error vs the clean engine; None: not stored):", verdict)
        wrong = [v for v in verdict if v[2] is not None and v[2] > 0.02]
        assert not wrong, f"blocks stored with KV that never loaded: {wrong}"
        assert not [v for v in verdict if v[2] is None], f"full blocks never stored: {verdict}"
    finally:
        daemon.stop()
        clean.stop()
