"""Runs a real vLLM (CPU build) for tests/integration/test_vllm_e2e.py; one JSON spec in, one JSON result out.

Not a test module: the end-to-end test starts it in a fresh process per engine (vLLM spawns its
Worker processes, hence the __main__ guard). The connector is named ``KvbmConnector`` with no module
path: vLLM finds it through kvbm's ``vllm.general_plugins`` entry point, as ``vllm serve`` would.

EngineCore runs in this process (the test sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that, after each
step, the runner can read which vLLM blocks hold the prompt and ask every worker (TP rank) for a digest
of those blocks' KV bytes: the test compares them with an engine that computed the prompt itself. Workers
import this module for the ``KVDigest`` extension (the test puts tests/ on PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


class KVDigest:
    """vLLM worker extension: SHA-256 of every layer's bytes of the given vLLM blocks, in layer order."""

    def kvbm_test_digest(self, block_ids: list[int]) -> list[str]:
        import torch

        caches: list[torch.Tensor] = list(self.model_runner.kv_caches)  # type: ignore[attr-defined]
        num_blocks = self.model_runner.kv_cache_config.num_blocks  # type: ignore[attr-defined]
        out = []
        for b in block_ids:
            h = hashlib.sha256()
            for cache in caches:
                bdim = next((d for d, s in enumerate(cache.shape) if s == num_blocks), 0)
                h.update(cache.select(bdim, b).contiguous().view(torch.uint8).numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def kvbm_test_saves_done(self) -> bool:
        """Whether every save the connector's worker side started has finished (committed or dropped)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        return all(f.done() for futs in worker._saving.values() for f in futs)


def prompt_block_ids(llm: Any, prompt: list[int], n: int) -> list[int]:
    """The vLLM block ids of the prompt's first ``n`` full blocks, from the prefix cache's hash map."""
    from kvbm.vllm_hash import vllm_block_hashes

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    ids = []
    for h in vllm_block_hashes(prompt, bs, seed=os.environ["PYTHONHASHSEED"])[:n]:
        blocks = pool.get_cached_block(h, [0])
        assert blocks, f"prompt block {len(ids)} is not in vLLM's prefix cache"
        ids.append(blocks[0].block_id)
    return ids


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    tp = spec.get("tp", 1)
    # Prefix caching stays on so the prompt's blocks can be found after a step; it is reset between steps
    # so that a later step can only be served by kvbm.
    kw: dict[str, Any] = dict(model=spec["model"], enforce_eager=True, enable_prefix_caching=True,
                              skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=4, seed=0,
                              worker_extension_cls="vllm_runner.KVDigest")
    if tp > 1:
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = {"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": spec["connector"]}
    if spec.get("events"):
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec["events"],
                                  "topic": "kv"}
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    results = []
    prompt = spec["prompt"]
    for step in spec["steps"]:
        if step.get("evict"):
            from pathlib import Path

            from kvbm.client import WorkerClient
            from kvbm.security import read_admin_token

            conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
            removed = 0
            token = read_admin_token(Path(spec["admin_token_file"]))  # evicting needs the daemon's admin token
            for layout in conn.layouts():
                with WorkerClient(spec["connector"]["daemon"], timeout_s=10, admin_token=token) as c:
                    c.register(layout, worker_id=f"e2e-evictor-r{layout.tp_rank}")
                    removed += c.evict(namespace=layout.namespace, tiers=step["evict"]).removed
            results.append({"evicted": removed})
            continue
        if "follow_up" in step:
            # The next turn of a conversation: the previous prompt, its answer, and the new question.
            prompt = prompt + results[-1]["tokens"] + step["follow_up"]
        step_params = params
        if "max_tokens" in step:
            step_params = SamplingParams(max_tokens=step["max_tokens"], ignore_eos=True,
                                         temperature=0.0, detokenize=False)
        out = llm.generate([{"prompt_token_ids": prompt}], step_params, use_tqdm=False)[0]
        res: dict[str, Any] = {
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
        }
        if spec.get("digest_blocks"):
            ids = prompt_block_ids(llm, spec["prompt"], spec["digest_blocks"])
            res["kv_digests"] = llm.collective_rpc("kvbm_test_digest", args=(ids,))  # one list per TP rank
        if step.get("settle"):
            # Until the async saves are in the daemon (the next step's lookup must see all of them) and the
            # blocks vLLM kept for them are free: engine steps carry the finished requests to the worker,
            # whose report frees them.
            core = llm.llm_engine.engine_core.engine_core
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all(llm.collective_rpc("kvbm_test_saves_done")) and not core.scheduler.has_requests():
                    break
                core.step_fn()
                time.sleep(0.05)
        res["prompt_tokens"] = len(prompt)
        res["prefix_cache_reset"] = llm.reset_prefix_cache()
        results.append(res)
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
