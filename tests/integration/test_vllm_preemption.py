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


def test_blocks_saved_across_preemption_hold_their_own_tokens_kv(tmp_path, tiny_model):
    prompts = [[(i * (7 + 2 * r) + 11 * r) % 991 + 3 for i in range(300)] for r in range(6)]
    answer = 470  # 770 tokens a request: 3 full kvbm blocks, the last one made of answer tokens only
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
        texts = [p + out for p, out in zip(prompts, run["batch_tokens"], strict=True)]
        assert all(len(t) == 300 + answer for t in texts)
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
