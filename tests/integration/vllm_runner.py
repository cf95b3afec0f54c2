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

    def kvbm_test_poison(self) -> None:
        """Fill every KV cache with one value, so that a later step's blocks hold only what it computed or
        loaded: an engine that stores in one step and loads in the next is then as strict an oracle as a fresh
        engine (a load that wrote nothing shows the poison in the digests, not the earlier step's bytes)."""
        for cache in self.model_runner.kv_caches:  # type: ignore[attr-defined]
            cache.fill_(7)

    def kvbm_test_saves_done(self) -> bool:
        """Whether every save the connector's worker side started has finished (committed or dropped)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
        saver = getattr(worker, "saver", None)
        if saver is None:  # the connector before its saves had a class of their own (a test run on old code)
            return all(f.done() for futs in worker._saving.values() for f in futs)
        return not saver.pending()


    def kvbm_test_group_digests(self, ids_by_group: list[list[int | None]]) -> list[list[str | None]]:
        """Per KV-cache group (vLLM's hybrid KV cache manager): SHA-256 of that group's layers' bytes of each
        given block id (None stays None)."""
        import torch
        from vllm.model_executor.models.utils import extract_layer_index

        runner = self.model_runner  # type: ignore[attr-defined]
        groups = runner.kv_cache_config.kv_cache_groups
        names = sorted((n for g in groups for n in g.layer_names), key=extract_layer_index)
        cache_of = dict(zip(names, runner.kv_caches, strict=True))  # the runner's list is in layer order
        num_blocks = runner.kv_cache_config.num_blocks
        out: list[list[str | None]] = []
        for group, ids in zip(groups, ids_by_group, strict=True):
            digests: list[str | None] = []
            for b in ids:
                if b is None:
                    digests.append(None)
                    continue
                h = hashlib.sha256()
                for name in sorted(group.layer_names, key=extract_layer_index):
                    cache = cache_of[name]
                    bdim = next((d for d, s in enumerate(cache.shape) if s == num_blocks), 0)
                    h.update(cache.select(bdim, b).contiguous().view(torch.uint8).numpy().tobytes())
                digests.append(h.hexdigest())
            out.append(digests)
        return out

    def kvbm_test_pp_buffers(self) -> None:
        """Allocate a later PP stage's buffer for the activations it receives, as vLLM's dummy run does:
        with enforce_eager vLLM's CPU worker skips that run, and its first step then fails
        (``assert self.intermediate_tensors is not None``)."""
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner  # type: ignore[attr-defined]
        if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def prompt_block_ids(llm: Any, prompt: list[int], n: int) -> list[int]:
    """The vLLM block ids of the prompt's first ``n`` full blocks, from the prefix cache's hash map."""
    from kvbm.blocks.vllm_hash import vllm_block_hashes

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    ids = []
    for h in vllm_block_hashes(prompt, bs, seed=os.environ["PYTHONHASHSEED"])[:n]:
        blocks = pool.get_cached_block(h, [0])
        assert blocks, f"prompt block {len(ids)} is not in vLLM's prefix cache"
        ids.append(blocks[0].block_id)
    return ids


class AllocatedBlocks:
    """The vLLM block ids, per KV-cache group, that the scheduler allocated to the last admitted request,
    recorded from the scheduler's connector: how the prompt's blocks are found where vLLM's prefix cache
    does not hold them (MLA on CPU turns it off; a sliding-window group frees blocks outside its window).
    Nothing reuses them before the runner reads their digests: one request runs at a time."""

    def __init__(self, llm: Any) -> None:
        self.ids: list[list[int]] = []
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        inner = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            self.ids = [list(ids) for ids in blocks.get_block_ids()]
            return inner(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc


class EvictBeforeLoad:
    """Evicts a request's kvbm blocks from ``from_block`` on right after the scheduler planned their load (the
    lookup said they were there): a block gone between lookup and load, so the load comes up short. A synchronous
    load's blocks are pinned by its lookup, so none can go: their slots are taken out of the load's pins instead
    (what the worker cannot copy, a pool it has not mapped, comes up short the same way)."""

    def __init__(self, llm: Any, spec: dict, from_block: int) -> None:
        from pathlib import Path

        from kvbm.client import WorkerClient
        from kvbm.security import read_admin_token

        self.evicted = 0
        self.active = True  # per step: a step with "evict_before_load": false loads what is there
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        inner = conn.update_state_after_alloc
        token = read_admin_token(Path(spec["admin_token_file"]))

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            out = inner(request, blocks, num_external_tokens)
            k = conn.scheduler.geometry.known_k
            if self.active and num_external_tokens > 0 and k:
                hashes = [bytes(h) for h in request.block_hashes[k - 1 :: k]][from_block:]
                st = conn.scheduler._reqs.get(request.request_id)
                if spec.get("evict_partial") and st is not None and st.partial:
                    hashes.append(st.partial)  # the partial block its load planned, gone too
                for layout in conn.layouts():
                    with WorkerClient(spec["connector"]["daemon"], timeout_s=10, admin_token=token) as c:
                        c.register(layout, worker_id=f"e2e-evictor-r{layout.tp_rank}")
                        self.evicted += c.evict(hashes).removed
                load = st.load if st is not None else None
                if load is not None and load.pins:
                    keep = max(0, from_block - st.load_from)
                    self.evicted += max(0, len(load.hashes) - keep)
                    load.pins = {r: (gen, slots[:keep], nbytes[:keep]) for r, (gen, slots, nbytes) in load.pins.items()}
                    load.unpinned_rest = False
            return out

        conn.update_state_after_alloc = update_state_after_alloc


def settle(llm: Any) -> None:
    """Until the async saves are in the daemon (the next step's lookup must see all of them) and the blocks
    vLLM kept for them are free: engine steps carry the finished requests to the worker, whose report frees
    them."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(llm.collective_rpc("kvbm_test_saves_done")) and not core.scheduler.has_requests():
            break
        core.step_fn()
        time.sleep(0.05)


_stepped_runs = 0


def stepped(llm: Any, plan: dict) -> dict:
    """Requests stepped one engine step at a time, with ``reset_prefix_cache(reset_running_requests=True)``
    (every running request preempted and admitted again in the next step, as an RL weight sync's
    ``pause_generation(mode="keep")`` does) after ``reset_after`` steps. The run is capped in wall-clock
    seconds, not steps, so a request that never finishes shows as stuck instead of hanging the test: a step that
    schedules nothing (every request waiting for its async load) takes well under a millisecond, so a step cap
    (it was 2,000) called a load that took a second on a busy machine stuck."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=plan["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    global _stepped_runs
    _stepped_runs += 1  # request ids unique per run: a later run never reuses an earlier one's
    ids = [f"stepped{_stepped_runs}-{i}" for i in range(len(plan["batch"]))]
    for rid, q in zip(ids, plan["batch"], strict=True):
        engine.add_request(rid, {"prompt_token_ids": q}, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = resets = 0
    t0 = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - t0 < plan.get("max_seconds", 120.0):
        # vLLM cannot reset while a request waits for its async load: the reset comes once none does.
        if steps >= plan["reset_after"] >= 0 and not resets and not any(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in sched.requests.values()):
            llm.reset_prefix_cache(reset_running_requests=True)
            resets += 1
        for out in engine.step():
            if out.request_id in tokens and out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    settle(llm)
    return {"batch_tokens": [tokens[r] for r in ids], "steps": steps, "resets": resets,
            "seconds": round(time.monotonic() - t0, 3), "stuck": engine.has_unfinished_requests()}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    # Prefix caching stays on so the prompt's blocks can be found after a step; it is reset between steps
    # so that a later step can only be served by kvbm.
    kw: dict[str, Any] = dict(model=spec["model"], enforce_eager=True, enable_prefix_caching=True,
                              skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=4, seed=0,
                              worker_extension_cls="vllm_runner.KVDigest")
    if tp * pp > 1:
        kw.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp")
    if spec.get("attention_backend"):
        kw["attention_config"] = {"backend": spec["attention_backend"]}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = {"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": spec["connector"]}
    if spec.get("events"):
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec["events"],
                                  "topic": "kv"}
    kw.update(spec.get("engine") or {})  # e.g. a small KV cache (num_gpu_blocks_override) to force preemption
    llm = LLM(**kw)
    if pp > 1:
        llm.collective_rpc("kvbm_test_pp_buffers")
    prefix_cache = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    allocated = AllocatedBlocks(llm) if spec.get("connector") is not None else None
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    evictor = EvictBeforeLoad(llm, spec, spec["evict_before_load"]) if spec.get("evict_before_load") else None
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
        if "batch" in step:
            # Many requests at once (ignore_eos, max_tokens each): under a small KV cache vLLM preempts some.
            bp = SamplingParams(max_tokens=step["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)
            sched = llm.llm_engine.engine_core.engine_core.scheduler
            preempted: list[str] = []
            inner_preempt = sched._preempt_request

            def preempt(request: Any, *a: Any, preempted: list[str] = preempted, inner: Any = inner_preempt,
                        **k: Any) -> Any:
                preempted.append(request.request_id)
                return inner(request, *a, **k)

            sched._preempt_request = preempt
            if step.get("poison"):  # the blocks hold only what this step computes or loads
                llm.collective_rpc("kvbm_test_poison")
            outs = llm.generate([{"prompt_token_ids": q} for q in step["batch"]], bp, use_tqdm=False)
            res = {"batch_tokens": [list(o.outputs[0].token_ids) for o in outs],
                   "kv_transfer_params": [o.kv_transfer_params for o in outs], "preempted": preempted}
            import msgspec

            res["layouts"] = [msgspec.json.encode(lay).decode() for lay in sched.connector.layouts()]
            settle(llm)
            results.append(res)
            continue
        if "stepped" in step:
            results.append(stepped(llm, step["stepped"]))
            continue
        if evictor is not None:
            evictor.active = step.get("evict_before_load", True)
        if step.get("poison"):
            # Only after the last step's prefix cache was reset (or with none): no block holds what vLLM may reuse.
            assert results and results[-1].get("prefix_cache_reset") is not False, "the prefix cache was not reset"
            llm.collective_rpc("kvbm_test_poison")
        if "prompt" in step:
            prompt = step["prompt"]
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
            if not prefix_cache:
                assert allocated is not None, "without vLLM's prefix cache the blocks come from the connector"
                ids = allocated.ids[0][: spec["digest_blocks"]]
            else:
                ids = prompt_block_ids(llm, spec["prompt"], spec["digest_blocks"])
            # One list per worker, in rank order (PP stage-major, then TP rank).
            res["kv_digests"] = llm.collective_rpc("kvbm_test_digest", args=(ids,))
        if spec.get("group_digest_blocks"):
            assert allocated is not None, "group digests read the blocks the connector saw allocated"
            null = 0  # vLLM's null block: a sliding-window block outside the window, never loaded
            group_ids = [[None if b == null else b for b in ids[: spec["group_digest_blocks"]]]
                         for ids in allocated.ids]
            res["group_block_ids"] = group_ids
            res["group_digests"] = llm.collective_rpc("kvbm_test_group_digests", args=(group_ids,))
            res["group_windows"] = [getattr(g.kv_cache_spec, "sliding_window", None) for g in
                                    llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups]
        if step.get("settle"):
            settle(llm)
        if evictor is not None:
            res["evicted_before_load"] = evictor.evicted
        res["prompt_tokens"] = len(prompt)
        # keep_prefix_cache: the next step may hit vLLM's own cache too (a local hit before kvbm's)
        res["prefix_cache_reset"] = llm.reset_prefix_cache() if prefix_cache and not step.get("keep_prefix_cache") \
            else None
        results.append(res)
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
