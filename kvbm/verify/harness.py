"""Run one seed's schedule against the real engine and daemon, then a clean engine, and check the invariants.

1. ``block_kv``: every block kvbm holds is the KV of its own tokens: relative error per block against the block a
   clean engine (one request at a time, nothing loaded) stored for the same tokens, within batching noise.
2. ``engine_alive`` / ``none_stuck``: no exception out of a step or an op, every request finished or aborted. A
   reset vLLM refuses while blocks are held for async transfers is asked again as the engine steps; one still
   refused after ``RESET_RETRY_S`` is the violation (:mod:`kvbm.verify.engine`).
3. ``tokens_after_hit``: a finished request that loaded from kvbm answers what the clean engine answers, token
   for token (greedy, float32). Requests without a hit are the control: their mismatches measure the noise.
4. ``blocks_stored``: every full block of a finished request is stored, unless a counted reason explains it
   (the daemon was stopped or killed, a connector reset started a new epoch, the connector degraded).
5. ``hook_time``: the most a step spent in the connector's hooks, less its own copies (a synchronous load's into
   vLLM's blocks, ``async_save: false``'s out of them), is at most 5 ms (the hook-time histograms the connector
   writes under ``KVBM_HOOK_TIMES_DIR``).
Plus ``stale_after_reset`` (checked in the engine process): no load after ``reset_prefix_cache(reset_connector=
True)`` or a clearing pause serves a block stored before it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbm.verify.engine import HASH_SEED, kvbm_hashes
from kvbm.verify.schedule import Schedule, generate
from kvbm.verify.zygote import run_forked

BLOCK_TOLERANCE = 0.01  # float32 batching noise is ~1e-6; a block of other tokens is off by ~1
HOOK_BUDGET_MS = 5.0
INVARIANTS = ("block_kv", "engine_alive", "none_stuck", "tokens_after_hit", "blocks_stored", "hook_time",
              "stale_after_reset")


MODELS = ("llama", "gemma2")  # a single KV-cache group; a hybrid one (sliding window + full attention)


def write_model(root: Path, model: str = "llama") -> str:
    """A tiny random float32 model, written once under ``root``: ``llama`` (2 layers, 2 KV heads of 32: 128 KiB per
    128-token vLLM block) or ``gemma2`` (Gemma-2-style: layer 0 attends within a 256-token sliding window, layer 1
    to everything; vLLM runs them as two KV-cache groups)."""
    if model not in MODELS:
        raise ValueError(f"model: one of {', '.join(MODELS)}, got {model!r}")
    path = root / f"tiny-{model}-f32"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, torch_dtype="float32")
    if model == "gemma2":
        Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=32, sliding_window=256)).save_pretrained(path)
    else:
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(path)
    return str(path)


def run_engine(root: Path, name: str, spec: dict[str, Any], timeout_s: float = 900) -> dict[str, Any]:
    """One engine process; its JSON result, with ``npz`` (the blocks it read back) and ``hooks`` (its hook times)."""
    hooks = root / f"{name}-hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    spec_path, out = root / f"{name}.spec.json", root / f"{name}.out.json"
    spec_path.write_text(json.dumps({**spec, "root": str(root / name)}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": HASH_SEED,
           "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVBM_HOOK_TIMES_DIR": str(hooks)}
    log = root / f"{name}.log"
    # A fork of a pre-imported vLLM (kvbm.verify.zygote): a schedule's two engines skip 12 s of imports each.
    rc = run_forked("kvbm.verify.engine:main", [str(spec_path), str(out)], log, env, timeout_s,
                    preload=("kvbm.verify.engine",))
    if rc != 0 or not out.exists():
        return {"crashed": f"exit {rc}: {log.read_text()[-3000:]}"}
    res = json.loads(out.read_text())
    if "harness_error" in res:
        return res
    with np.load(str(out) + ".npz") as z:
        res["npz"] = {k: z[k] for k in z.files}
    res["hooks"] = {f.name.split("-")[0]: json.loads(f.read_text()) for f in hooks.glob("*.json")}
    return res


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    ta, tb = a.view(np.float32).astype(np.float64), b.view(np.float32).astype(np.float64)
    return float(np.linalg.norm(ta - tb) / max(np.linalg.norm(tb), 1e-12))


def describe_tokens(got: list[int], want: list[int], names: tuple[str, str] = ("kvbm", "computed")) -> str:
    i = next((j for j, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
    shift = ""
    if got[i:i + 8] == want[i + 1:i + 9] and len(got[i:i + 8]) > 1:
        shift = f" (one token ahead of the {names[1]} answer)"
    elif got[i + 1:i + 9] == want[i:i + 8] and len(want[i:i + 8]) > 1:
        shift = f" (one token behind the {names[1]} answer)"
    return f"first differs at token {i}: {names[0]} {got[i:i + 6]} vs {names[1]} {want[i:i + 6]}{shift}"


def check(sched: Schedule, pressure: dict[str, Any], clean: dict[str, Any]) -> dict[str, Any]:
    """The invariants over one schedule's two runs: the seed's report."""
    seed = sched.seed
    violations: list[dict[str, Any]] = [{**v, "seed": seed} for v in pressure.get("violations", [])]
    counts = {"blocks_checked": 0, "blocks_stored": 0, "blocks_expected": 0, "blocks_missing_explained": {},
              "hit_requests": 0, "control_requests": 0, "control_mismatches": 0, "max_error_within_tolerance": 0.0}
    if "crashed" in pressure:
        violations.append({"invariant": "engine_alive", "seed": seed, "request": None,
                           "detail": pressure["crashed"]})
        return {"seed": seed, "violations": violations, "counts": counts}
    if "crashed" in clean:  # run_seed reports it as the harness's error, not the connector's
        raise HarnessError(f"seed {seed}: the clean engine failed: {clean['crashed']}")
    k, reqs = pressure["k"], pressure["requests"]
    got_blocks, want_blocks = pressure["npz"], clean["npz"]
    explained = counts["blocks_missing_explained"]
    for rid, r in sorted(reqs.items()):
        hashes = kvbm_hashes(r["prompt"] + r["output"], k)
        for i, h in enumerate(hashes):
            g, w = got_blocks.get(h.hex()), want_blocks.get(h.hex())
            if g is not None:
                counts["blocks_checked"] += 1
                if w is None:
                    raise RuntimeError(f"seed {seed}: the clean engine did not store {rid}'s block {i}")
                err = relative_error(g, w)
                if err <= BLOCK_TOLERANCE:  # the noise floor: how close the right blocks are
                    counts["max_error_within_tolerance"] = max(counts["max_error_within_tolerance"], err)
                else:
                    violations.append({"invariant": "block_kv", "seed": seed, "request": rid, "block": i,
                                       "detail": f"stored block {i} differs from the computed one by {err:.3g} "
                                       f"(preempted {r['preempted']}x, external loads {r['external']})"})
            if r["status"] != "finished":
                continue
            counts["blocks_expected"] += 1
            if g is not None:
                counts["blocks_stored"] += 1
                continue
            params = (r.get("params") or {}).get("kvbm") or {}
            why = ("daemon_fault" if pressure["faults"] else "connector_reset" if pressure["resets"]
                   else "degraded" if params.get("degraded") else None)
            if why:
                explained[why] = explained.get(why, 0) + 1
            else:
                violations.append({"invariant": "blocks_stored", "seed": seed, "request": rid, "block": i,
                                   "detail": f"full block {i} of {len(hashes)} never stored "
                                   f"(async_save {sched.engine.async_save}, {len(r['output'])} tokens out)"})
        if r["status"] != "finished":
            continue
        hit = any(n > 0 for _, n in r["external"])
        want = clean["tokens"][rid]
        if hit:
            counts["hit_requests"] += 1
            if r["output"] != want:
                violations.append({"invariant": "tokens_after_hit", "seed": seed, "request": rid,
                                   "detail": f"{describe_tokens(r['output'], want)}; loads {r['external']}, "
                                   f"preempted {r['preempted']}x"})
        else:
            counts["control_requests"] += 1
            counts["control_mismatches"] += r["output"] != want
    worst = hook_excess(pressure.get("hooks", {}))
    counts["hook_step_max_ms"] = worst
    # Shown beside hook_time: the slowest sync load's start_load_kv and async_save: false's wait_for_save, copies
    # included (hook_time leaves the copies out, not what they wait on).
    worker = pressure.get("hooks", {}).get("worker", {}).get("hooks", {})
    counts["sync_load_max_ms"] = worker.get("start_load_kv", {}).get("max_ms", 0.0) if not sched.engine.async_load \
        else 0.0
    counts["sync_save_max_ms"] = worker.get("wait_for_save", {}).get("max_ms", 0.0) if not sched.engine.async_save \
        else 0.0
    if worst > HOOK_BUDGET_MS:
        violations.append({"invariant": "hook_time", "seed": seed, "request": None,
                           "detail": f"a step spent {worst:.1f} ms in the connector's hooks beyond its sync "
                           f"load copies (budget {HOOK_BUDGET_MS} ms; daemon faults {pressure['faults']})"})
    return {"seed": seed, "steps": pressure.get("steps"), "violations": violations, "counts": counts,
            "events": pressure.get("events", [])}


def hook_excess(hooks: dict[str, Any]) -> float:
    """The slowest step's hook time on either side, less that step's own copies on the worker's side (a
    synchronous load's into vLLM's blocks, ``async_save: false``'s out of them: the connector counts them); a
    daemon round trip is not a copy."""
    worst = 0.0
    for side, h in hooks.items():
        step = h.get("step_beyond_copies", h["step"]) if side == "worker" else h["step"]
        worst = max(worst, step["max_ms"])
    return round(worst, 3)


class HarnessError(RuntimeError):
    """The harness's own part failed (its daemon did not start, the clean engine crashed): nothing to judge."""


def run_seed(seed: int, root: Path, model: str, *, faults: bool = True, family: str = "llama",
             attempts: int = 2) -> dict[str, Any]:
    """Generate, run and check seed ``seed`` on ``model`` (the path :func:`write_model` wrote for ``family``; work
    files under ``root/seed-N``). A harness error is run again (``attempts`` in all), then reported as
    ``harness_error``, never as a violation of the connector's invariants."""
    sched = generate(seed, faults=faults, model=family)
    plain = msgspec.to_builtins(sched)
    for attempt in range(attempts):
        work = root / f"seed-{seed}-{family}" / f"try-{attempt}"
        work.mkdir(parents=True, exist_ok=True)
        try:
            report = _run_pair(sched, plain, work, model)
            break
        except HarnessError as e:
            report = {"seed": seed, "violations": [], "counts": {"blocks_checked": 0, "blocks_stored": 0,
                      "blocks_expected": 0, "blocks_missing_explained": {}, "hit_requests": 0,
                      "control_requests": 0, "control_mismatches": 0}, "harness_error": str(e)[-3000:]}
    report["model"] = family
    report["ops"] = sched.op_counts()
    report["engine"] = msgspec.to_builtins(sched.engine)
    return report


def _run_pair(sched: Schedule, plain: dict[str, Any], work: Path, model: str) -> dict[str, Any]:
    """The schedule under pressure, then each of its requests on a clean engine; the checked report."""
    pressure = run_engine(work, "pressure", {"role": "pressure", "model": model, "schedule": plain})
    if "harness_error" in pressure:
        raise HarnessError(f"seed {sched.seed}: {pressure['harness_error']}")
    clean: dict[str, Any] = {}
    if "crashed" not in pressure:
        jobs = {r: {"prompt": q["prompt"], "output": q["output"]} for r, q in pressure["requests"].items()}
        clean = run_engine(work, "clean", {"role": "clean", "model": model, "schedule": plain, "jobs": jobs})
    report = check(sched, pressure, clean)
    report["preemptions"] = sum(r["preempted"] for r in pressure.get("requests", {}).values())
    return report
