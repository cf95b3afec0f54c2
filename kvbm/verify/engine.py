"""One engine of a schedule, in a fresh process: ``python -m kvbm.verify.engine SPEC OUT``.

vLLM's CPU build with EngineCore in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the harness
steps it one step at a time, runs the schedule's operations between steps, and sees the scheduler's requests
(which wait for a remote load) and the blocks the connector was told to load. This process owns its daemon:
it SIGSTOPs, SIGKILLs and restarts it at the schedule's steps, and at the end reads back every full block of
every request's tokens into ``OUT.npz`` for the harness to compare with a clean engine's.

Two roles: ``pressure`` runs the schedule (a small KV cache, random operations); ``clean`` computes each
request's tokens alone, with a KvbmConnector that saves but never loads: the reference blocks and tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbm.verify.daemon import VerifyDaemon
from kvbm.verify.schedule import VLLM_BLOCK, Schedule
from kvbm.verify.settle import settle

HASH_SEED = "0"  # PYTHONHASHSEED of the engine: vLLM's block hashes depend on it
MAX_STEPS = 4000
STUCK_S = 60.0  # a schedule that has not drained after this long has a stuck request (they take ~10 s)
# vLLM refuses a reset with running requests (raises) while blocks stay held after it preempted them all (requests
# waiting for an async load): a weight sync keeps stepping and asks again. Still refused after this: a violation.
RESET_REFUSED = "Failed to reset KV cache"
RESET_RETRY_S = 20.0
RETRY_STEPS = {"pause_loading": 2000}  # how long an op with nothing to do yet is retried (else 20 steps)


def kvbm_hashes(tokens: list[int], k: int) -> list[bytes]:
    """The kvbm block hashes of every full kvbm block of ``tokens`` whose KV was computed (the last token is
    sampled, never fed back)."""
    from kvbm.blocks.vllm_hash import vllm_block_hashes

    full = (len(tokens) - 1) // (k * VLLM_BLOCK)
    return vllm_block_hashes(tokens[: full * k * VLLM_BLOCK], VLLM_BLOCK, seed=HASH_SEED)[k - 1 :: k]


def external_id(request_id: str) -> str:  # vLLM appends ``-<random suffix>`` to the harness's request id
    return request_id.rsplit("-", 1)[0]


def make_llm(model: str, sched: Schedule, daemon: VerifyDaemon, load: bool) -> Any:
    from vllm import LLM

    eng = sched.engine
    conn = {"daemon": daemon.endpoint, "model_name": "kvbm-verify", "timeout_s": 2, "load": load,
            "async_load": eng.async_load, "async_save": eng.async_save}
    blocks = eng.num_gpu_blocks if load else 64  # the clean engine runs one request at a time, no pressure
    return LLM(model=model, enforce_eager=True, enable_prefix_caching=True, skip_tokenizer_init=True,
               dtype="float32", seed=0, max_model_len=eng.max_model_len, max_num_seqs=eng.max_num_seqs,
               num_gpu_blocks_override=blocks, worker_extension_cls="kvbm.verify.settle.VerifyWorker",
               kv_transfer_config={"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": conn})


class Pressure:
    """Runs a schedule step by step and records what happened to each request."""

    def __init__(self, llm: Any, sched: Schedule, daemon: VerifyDaemon) -> None:
        from vllm import SamplingParams

        self.llm, self.sched, self.daemon = llm, sched, daemon
        self.eng = llm.llm_engine
        self.core = self.eng.engine_core.engine_core
        self.scheduler = self.core.scheduler
        self.params = SamplingParams
        self.step = 0
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.status: dict[str, str] = {}  # finished | aborted
        self.added_at: dict[str, int] = {}
        self.external: dict[str, list[tuple[int, int]]] = {}  # (step, external tokens) at each allocation
        self.preempted: dict[str, int] = {}
        self.params_out: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []  # what each op did
        self.violations: list[dict[str, Any]] = []
        self.faults = 0  # daemon SIGSTOP/SIGKILL
        self.resets: list[int] = []  # steps of connector resets
        self.old_hashes: set[bytes] = set()  # kvbm blocks of tokens computed before the last connector reset
        self.new_hashes: set[bytes] = set()  # ... and since
        self.k = 0
        self.pending: list[tuple[int, str]] = []  # (step, what): resumes and retried ops
        self.refused: list[tuple[float, str, str]] = []  # (first refused at, op, why): resets asked again each step
        self._hook()

    def _hook(self) -> None:
        conn = self.scheduler.connector
        inner = conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            rid = external_id(request.request_id)
            self.external.setdefault(rid, []).append((self.step, num_external_tokens))
            self.k = self.k or conn.scheduler.geometry.known_k
            if num_external_tokens > 0 and self.k and self.resets:
                toks = list(request.all_token_ids)
                n = (request.num_computed_tokens + num_external_tokens) // (self.k * VLLM_BLOCK)
                stale = [i for i, h in enumerate(kvbm_hashes(toks, self.k)[:n])
                         if h in self.old_hashes and h not in self.new_hashes]
                if stale:
                    self.violations.append({"invariant": "stale_after_reset", "request": rid, "step": self.step,
                                            "blocks": stale, "detail": "a load served blocks stored before "
                                            f"reset_connector at step {self.resets[-1]}"})
            if self.k:
                self.new_hashes.update(kvbm_hashes(list(request.all_token_ids), self.k))
            return inner(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = update_state_after_alloc
        inner_preempt = self.scheduler._preempt_request

        def preempt(request: Any, *a: Any, **kw: Any) -> Any:
            rid = external_id(request.request_id)
            self.preempted[rid] = self.preempted.get(rid, 0) + 1
            return inner_preempt(request, *a, **kw)

        self.scheduler._preempt_request = preempt

    def live(self) -> list[str]:
        return sorted(r for r in self.added_at if r not in self.status)

    def _add(self, req: Any) -> None:
        prompt = list(req.prompt)
        if req.follow_up_of is not None:
            prompt = self.prompts[req.follow_up_of] + self.outputs.get(req.follow_up_of, []) + prompt
        prompt = prompt[: self.sched.engine.max_model_len - req.max_tokens - 1]
        self.prompts[req.id] = prompt
        if req.reset_before:
            self._op("reset_running", 0)
        self.added_at[req.id] = self.step
        self.outputs[req.id] = []
        p = self.params(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        self.eng.add_request(req.id, {"prompt_token_ids": prompt}, p)

    def _abort(self, rids: list[str], why: str) -> None:
        if rids:
            self.eng.abort_request(rids)
            for r in rids:
                self.status[r] = "aborted"
            self.events.append({"step": self.step, "op": why, "requests": rids})

    def _reset_epoch(self) -> None:
        self.resets.append(self.step)
        if self.k:  # what was computed so far: the blocks kvbm may hold from before the reset
            live = {external_id(r): q for r, q in self.scheduler.requests.items()}
            for r, p in self.prompts.items():
                toks = p + self.outputs[r]
                if r in live and r not in self.status:
                    toks = list(live[r].all_token_ids)[: live[r].num_computed_tokens + 1]
                self.old_hashes.update(kvbm_hashes(toks, self.k))
        self.new_hashes = set()

    def _op(self, kind: str, arg: int) -> bool:
        """Run one op; False: nothing to do now (an abort/pause_loading with no request loading: retried)."""
        ev: dict[str, Any] = {"step": self.step, "op": kind}
        if kind == "abort":
            live = self.live()
            if not live:
                return False
            self._abort([live[arg % len(live)]], kind)
            return True
        if kind in ("abort_loading", "pause_loading"):  # pause_loading: a directed schedule's weight sync
            from vllm.v1.request import RequestStatus

            loading = sorted(external_id(r) for r, q in self.scheduler.requests.items()
                             if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            loading = [r for r in loading if r not in self.status]
            if not loading:  # retried (run): a directed pause for RETRY_STEPS, 10 ms or more each
                time.sleep(0.01 if kind == "pause_loading" else 0)
                return False
            if kind == "abort_loading":
                self._abort([loading[arg % len(loading)]], kind)
                return True
            ev["loading"], kind = loading, "pause_abort"  # a pause while these requests' async loads run
        try:
            if kind == "reset_prefix_cache":
                ev["ok"] = self.eng.reset_prefix_cache()
            elif kind == "reset_running":
                ev["ok"] = self.eng.reset_prefix_cache(reset_running_requests=True)
            elif kind == "reset_connector":
                ev["ok"] = self.eng.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
                if ev["ok"]:
                    self._reset_epoch()
            elif kind == "pause_abort":  # pause_generation(mode="abort", clear_cache=True): a weight sync
                self.pending.append((self.step + arg, "resume"))  # also when the pause raises: it paused
                self._abort(self.live(), "pause_abort")
                self.core.pause_scheduler(mode="abort", clear_cache=True)
                self._reset_epoch()
            elif kind == "settle":  # a directed schedule's barrier: the saves so far are in the daemon, none running
                ev["ok"] = settle(self.llm, 30.0)
            elif kind == "pause_keep":
                self.pending.append((self.step + arg, "resume"))
                self.core.pause_scheduler(mode="keep", clear_cache=False)
            elif kind == "resume":
                self.core.resume_scheduler()
            elif kind == "daemon_stop":
                if self.daemon.stopped or not self.daemon.alive():
                    return False
                self.daemon.sigstop()
                self.faults += 1
                self.pending.append((self.step + arg, "daemon_cont"))
            elif kind == "daemon_cont":
                self.daemon.sigcont()
            elif kind == "daemon_kill":
                if self.daemon.stopped or not self.daemon.alive():
                    return False
                self.daemon.kill()
                self.faults += 1
                self.pending.append((self.step + arg, "daemon_restart"))
            elif kind == "daemon_restart":
                self.daemon.start()
            else:
                raise ValueError(f"unknown op {kind!r}")
        except Exception as e:  # an op the engine refused by raising (vLLM's contract: it returns False)
            from vllm.v1.request import RequestStatus

            ev["raised"] = repr(e)
            # Which blocks held the reset: requests waiting for an async load, or blocks kvbm's saves still hold
            loading = sum(q.status == RequestStatus.WAITING_FOR_REMOTE_KVS for q in self.scheduler.requests.values())
            pool = self.scheduler.kv_cache_manager.block_pool
            held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            why = (f"{kind} raised {e!r} ({loading} requests waiting for a remote load, {held} blocks not free, "
                   f"async_save {self.sched.engine.async_save})")
            if kind in ("reset_running", "reset_connector") and RESET_REFUSED in str(e):
                self.refused.append((time.monotonic(), kind, why))  # asked again after the next steps (run)
            elif kind == "pause_abort" and RESET_REFUSED in str(e):
                # The pause aborted every request, only its reset was refused: vLLM keeps the blocks of a request
                # aborted while its async load runs until the connector reports the load, a step later (vLLM's
                # limitation, with any async-loading connector; test_verify_directed.py). A sync resets again.
                self.refused.append((time.monotonic(), "reset_connector", why))
            else:
                self.violations.append({"invariant": "engine_alive", "step": self.step, "request": None,
                                        "detail": why})
        self.events.append(ev)
        return True

    def _retry_refused(self) -> None:
        """Ask again for each reset vLLM refused; one refused for :data:`RESET_RETRY_S` of steps is a violation
        (the blocks that held it were never let go)."""
        for item in list(self.refused):
            self.refused.remove(item)
            since, kind, _ = item
            n = len(self.refused)
            self._op(kind, 0)
            if len(self.refused) > n:  # refused again: the first refusal's time stands
                _, _, why = self.refused.pop()
                if time.monotonic() - since < RESET_RETRY_S:
                    self.refused.append((since, kind, why))
                else:
                    self.violations.append({"invariant": "engine_alive", "step": self.step, "request": None,
                                            "detail": f"still refused after {RESET_RETRY_S:g} s of steps: {why}"})

    def run(self) -> None:
        todo = sorted(self.sched.requests, key=lambda r: (r.arrival, r.id))
        ops = [(o.step, o.kind, o.arg) for o in self.sched.ops]
        t0 = time.monotonic()
        while self.step < MAX_STEPS and time.monotonic() - t0 < STUCK_S:
            for req in [r for r in todo if r.arrival <= self.step
                        and (r.follow_up_of is None or r.follow_up_of in self.status)]:
                self._add(req)
                todo.remove(req)
            for item in [o for o in ops if o[0] <= self.step]:
                ops.remove(item)
                if not self._op(item[1], item[2]) and self.step - item[0] < RETRY_STEPS.get(item[1], 20):
                    ops.append(item)  # retried at the next steps (an abort/pause_loading waits for a load)
            for item in [p for p in self.pending if p[0] <= self.step]:
                self.pending.remove(item)
                self._op(item[1], 0)
            self._retry_refused()
            if not todo and not self.live() and not self.pending and not ops and not self.refused:
                break
            for out in self.eng.step():
                self.outputs[out.request_id] = list(out.outputs[0].token_ids)
                if out.finished and out.request_id not in self.status:
                    self.status[out.request_id] = "finished"
                    self.params_out[out.request_id] = out.kv_transfer_params
            self.step += 1
        for _, what in sorted(self.pending):  # a paused scheduler or a stopped/killed daemon at the end
            self._op(what, 0)
        internal = {external_id(r): q for r, q in self.scheduler.requests.items()}
        for rid in self.live():
            q = internal.get(rid)
            self.violations.append({"invariant": "none_stuck", "request": rid, "step": self.step,
                                    "detail": f"not finished after {self.step} steps "
                                    f"(status {q.status.name if q else 'unknown to the scheduler'})"})


def run_pressure(spec: dict[str, Any], out: Path) -> None:
    sched = msgspec.convert(spec["schedule"], Schedule)
    try:
        daemon = VerifyDaemon(Path(spec["root"]) / "daemon")
        daemon.start()
    except Exception:  # the harness's own daemon (a starved machine): no engine ran, nothing to judge
        out.write_text(json.dumps({"harness_error": traceback.format_exc()[-3000:]}))
        return
    result: dict[str, Any] = {"violations": []}
    try:
        llm = make_llm(spec["model"], sched, daemon, load=True)
        p = Pressure(llm, sched, daemon)
        try:
            p.run()
            result["settled"] = settle(llm)
        except Exception:
            p.violations.append({"invariant": "engine_alive", "request": None, "step": p.step,
                                 "detail": traceback.format_exc()[-3000:]})
        layout = llm.llm_engine.engine_core.engine_core.scheduler.connector.layouts()
        result.update(steps=p.step, events=p.events, violations=p.violations, faults=p.faults, resets=p.resets,
                      k=p.k, layout=msgspec.json.encode(layout[0]).decode() if layout else None,
                      requests={r: {"prompt": p.prompts[r], "output": p.outputs[r], "status": p.status.get(r, "stuck"),
                                    "added_at": p.added_at[r], "external": p.external.get(r, []),
                                    "preempted": p.preempted.get(r, 0), "params": p.params_out.get(r)}
                                for r in p.added_at})
        read_back(daemon, result, out)
    finally:
        daemon.stop()
    out.write_text(json.dumps(result))


def read_back(daemon: VerifyDaemon, result: dict[str, Any], out: Path) -> None:
    """Every full block of every request's tokens that the daemon holds, into ``OUT.npz`` (key: hash hex)."""
    from kvbm.blocks.layout import KVLayout

    if not result.get("layout") or not result.get("k") or not daemon.alive():
        np.savez(str(out) + ".npz")
        return
    layout = msgspec.json.decode(result["layout"], type=KVLayout)
    hashes = {h for r in result["requests"].values() for h in kvbm_hashes(r["prompt"] + r["output"], result["k"])}
    got = daemon.read_blocks(layout, sorted(hashes))
    np.savez(str(out) + ".npz", **{h.hex(): b for h, b in got.items()})


def run_clean(spec: dict[str, Any], out: Path) -> None:
    """Each job's prompt alone, greedy, as many tokens as the pressured run made; where the answer differs,
    the pressured run's tokens too (so the clean daemon holds the reference of every block it stored)."""
    from vllm import SamplingParams

    sched = msgspec.convert(spec["schedule"], Schedule)
    daemon = VerifyDaemon(Path(spec["root"]) / "daemon")
    daemon.start()
    result: dict[str, Any] = {"tokens": {}}
    try:
        llm = make_llm(spec["model"], sched, daemon, load=False)
        core = llm.llm_engine.engine_core.engine_core

        def gen(prompt: list[int], n: int) -> list[int]:
            sp = SamplingParams(max_tokens=max(n, 1), ignore_eos=True, temperature=0.0, detokenize=False)
            o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            settle(llm)
            return list(o.outputs[0].token_ids)

        for rid, job in spec["jobs"].items():
            toks = gen(job["prompt"], len(job["output"]))
            result["tokens"][rid] = toks
            if job["output"] and toks != job["output"]:
                gen(job["prompt"] + job["output"], 1)
        result["k"] = core.scheduler.connector.scheduler.geometry.known_k
        layout = core.scheduler.connector.layouts()
        result["layout"] = msgspec.json.encode(layout[0]).decode() if layout else None
        result["requests"] = {r: {"prompt": j["prompt"], "output": j["output"]} for r, j in spec["jobs"].items()}
        read_back(daemon, result, out)
        del result["requests"]
    finally:
        daemon.stop()
    out.write_text(json.dumps(result))


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    (run_pressure if spec["role"] == "pressure" else run_clean)(spec, Path(out_path))


if __name__ == "__main__":
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "the harness steps an in-process EngineCore"
    main(sys.argv[1], sys.argv[2])
