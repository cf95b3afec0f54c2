"""``kvbm bench serve``'s workloads against one server: long-doc-qa, TTFT vs input length (vLLM alone; kvbm per
tier and S3 client), multi-turn, and a peer connector's one attempt."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from typing import Any

from kvbm.bench.common import percentile
from kvbm.bench.openai_server import VllmServer, client, free_port, server_command, stream_completion, words
from kvbm.bench.runner import BenchRun
from kvbm.bench.serve_daemon import BenchDaemon, Sampler, tier_counters, timeline
from kvbm.bench.serve_options import PEER_CONNECTORS, ServeBenchOptions
from kvbm.bench.serve_requests import Prompts, error_line, phase_summary, run_batch
from kvbm.bench.serve_stages import delta, read_stages, stage_row

# How long the warm-up after a daemon restart hits its prompt again until a hit's blocks are copied in.
WARM_HIT_S = 30.0


class Run:
    """What the phases share: options, model, prompts, each server's command; the work dir, S3 endpoint and log
    keeping of the bench's :class:`BenchRun`."""

    def __init__(self, o: ServeBenchOptions, bench: BenchRun, model: str) -> None:
        assert bench.srv is not None
        self.o, self.work, self.model, self.srv, self.echo = o, bench.work, model, bench.srv, bench.echo
        self.keep_log = bench.keep_log
        p = Prompts(o.vocab, o.seed)
        self.docs = [p.ids(o.doc_tokens) for _ in range(o.docs)]
        self.questions = [p.ids(o.query_tokens) for _ in range(o.docs * (o.queries + 1))]
        self.lengths = {n: [p.ids(n) for _ in range(o.repeats)] for n in o.lengths}
        self.turns = [[p.ids(o.turn_tokens) for _ in range(o.turns)] for _ in range(o.sessions)]
        self.servers: dict[str, Any] = {}
        self.hooks = self.work / "hooks"  # the connector's hook times and stage counters (KVBM_HOOK_TIMES_DIR)

    def server(self, source: str, connector: dict[str, Any] | None, env: dict[str, str] | None = None,
               python: str | None = None) -> VllmServer:
        o = self.o
        cmd = server_command(self.model, free_port(), connector=connector, block_size=o.block_size,
                             kv_bytes=o.vllm_kv_bytes, max_model_len=o.max_model_len, served_name="bench",
                             python=python or o.server_python or sys.executable, max_num_seqs=max(4, o.concurrency),
                             dtype=o.dtype)
        e = {"OMP_NUM_THREADS": str(o.omp_threads), "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        if connector is not None and connector.get("kv_connector") == "KvbmConnector":
            self.hooks.mkdir(parents=True, exist_ok=True)
            e["KVBM_HOOK_TIMES_DIR"] = str(self.hooks)
        self.servers[source] = {"command": cmd, "env": e}
        return VllmServer(cmd, self.work / f"vllm-{source}.log", env=e, start_timeout_s=900)


async def long_doc(run: Run, server: VllmServer, daemon: BenchDaemon | None) -> dict[str, Any]:
    """Warm-up (each document once), then Q queries per document in tile order, C in flight."""
    o = run.o
    cli = client(server, o.request_timeout_s)
    try:
        warm = [d + run.questions[i] for i, d in enumerate(run.docs)]
        tile = [run.docs[i % o.docs] + run.questions[o.docs + j] for j, i in enumerate(range(o.docs * o.queries))]
        sampler = Sampler(daemon, o.sample_s) if daemon else None
        async with sampler if sampler else contextlib.nullcontext():  # type: ignore[attr-defined]
            w_outs, w_wall = await run_batch(cli, server.model, warm, o.concurrency, o.max_tokens)
            if daemon:
                await asyncio.to_thread(daemon.wait_quiet)
            st0 = read_stages(run.hooks)
            t_q = time.time()
            q_outs, q_wall = await run_batch(cli, server.model, tile, o.concurrency, o.max_tokens)
            st1 = read_stages(run.hooks)
        out: dict[str, Any] = {"warmup": phase_summary(w_outs, w_wall), "queries": phase_summary(q_outs, q_wall),
                               "requests": [c.as_dict() | {"doc": i % o.docs} for i, c in enumerate(q_outs)]}
        if daemon:
            ok = [c for c in q_outs if c.error is None]
            out["stages"] = stage_row(delta(st0, st1), None, None) | {
                "requests": len(ok), "ttft_ms_mean": round(sum(c.ttft_s or 0 for c in ok) / len(ok) * 1e3, 1)
                if ok else None,
                "computed_after_hit_tokens_mean": round(
                    sum(c.prompt_tokens - (c.cached_tokens or 0) for c in ok) / len(ok), 1) if ok else None}
        if sampler:
            out["timeline"] = timeline(sampler.samples, o.block_bytes)
            out["queries_start_s"] = round(t_q - sampler.t0, 2)
            out["tier_totals"] = {k: v for k, v in sampler.samples[-1].items() if k != "t"} if sampler.samples else {}
        return out
    finally:
        await cli.close()


async def ttft_length_vllm(run: Run, server: VllmServer) -> dict[str, Any]:
    """Per length and repeat: the prompt with vLLM's cache emptied (recompute), then again (G1)."""
    o = run.o
    cli = client(server, o.request_timeout_s)
    res: dict[str, Any] = {"recompute": {}, "G1": {}}
    try:
        for n, prompts in run.lengths.items():
            for src in res:
                res[src][n] = []
            for p in prompts:
                await asyncio.to_thread(server.reset_prefix_cache)
                first = await stream_completion(cli, server.model, words(p), o.max_tokens)
                second = await stream_completion(cli, server.model, words(p), o.max_tokens)
                res["recompute"][n].append(first.as_dict())
                res["G1"][n].append(second.as_dict() | {"same_text": second.text == first.text})
            run.echo(f"    {n:>6} tokens: recompute {_p(res['recompute'][n])}, G1 {_p(res['G1'][n])}")
        return res
    finally:
        await cli.close()


def _p(rs: list[dict[str, Any]]) -> str:
    t = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    return f"p95 {percentile(t, 95) * 1e3:,.0f} ms (cached {rs[-1]['cached_tokens']})" if t else "failed"


async def ttft_length_kvbm(run: Run, server: VllmServer, daemon: BenchDaemon) -> dict[str, Any]:
    """Per length: store each prompt (first pass), then with vLLM's cache emptied and kvbm's upper tiers
    evicted, the same prompt from G2, G3 and G4 (per S3 client: the daemon restarted with it)."""
    o = run.o
    res: dict[str, Any] = {"first": {}, "G2": {}, "G3": {}, "G1-kvbm": {}}
    g2 = max(o.g2_bytes, 2 * max(o.lengths) * o.model_bytes_per_token + 4 * o.block_bytes)
    g3 = max(o.g3_bytes, 2 * sum(len(ps) * n for n, ps in run.lengths.items()) * o.model_bytes_per_token)
    await asyncio.to_thread(daemon.start, g2=g2, g3=g3, s3_client=o.s3_clients[0] if o.s3_clients else "http")
    cli = client(server, o.request_timeout_s)
    warm = Prompts(o.vocab, o.seed + 7)
    res["after_restart"] = {}

    async def after_restart(name: str) -> None:
        # vLLM's workers meet the restarted daemon on their next requests (re-register, map the new pool at their
        # first hit, which is computed meanwhile; a link that saw the daemon go backs off up to seconds first):
        # untimed requests of a fresh prompt, stored and then hit until a hit's blocks are copied in, take that
        # cost, recorded here, out of the first timed hit.
        prompt = words(warm.ids(2 * o.kvbm_block_tokens))
        await asyncio.to_thread(server.reset_prefix_cache)
        tries = [(await stream_completion(cli, server.model, prompt, o.max_tokens)).as_dict()]
        deadline = time.monotonic() + WARM_HIT_S
        while True:
            await asyncio.to_thread(daemon.wait_quiet)
            await asyncio.to_thread(server.reset_prefix_cache)
            st0 = read_stages(run.hooks)
            c = await stream_completion(cli, server.model, prompt, o.max_tokens)
            copied = int(delta(st0, read_stages(run.hooks)).get("worker", {}).get("copy_in_bytes", 0))
            tries.append(c.as_dict() | {"copy_in_bytes": copied})
            if copied or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        res["after_restart"][name] = tries
        await asyncio.to_thread(daemon.wait_quiet)

    try:
        await after_restart(o.s3_clients[0] if o.s3_clients else "http")
        for n, prompts in run.lengths.items():
            for src in ("first", "G2", "G3"):
                res[src][n] = []
            for p in prompts:
                await asyncio.to_thread(server.reset_prefix_cache)
                first = await stream_completion(cli, server.model, words(p), o.max_tokens)
                res["first"][n].append(first.as_dict())
                await asyncio.to_thread(daemon.wait_quiet)
                for src, evict in (("G2", []), ("G3", ["G2"])):
                    await asyncio.to_thread(server.reset_prefix_cache)
                    if evict:
                        await asyncio.to_thread(daemon.evict, evict)
                    before = tier_counters(await asyncio.to_thread(daemon.wait_quiet))
                    st0 = read_stages(run.hooks)
                    c = await stream_completion(cli, server.model, words(p), o.max_tokens)
                    st1 = read_stages(run.hooks)
                    after = tier_counters(await asyncio.to_thread(daemon.stats))
                    hits = _hits(before, after)
                    res[src][n].append(c.as_dict() | {"same_text": c.text == first.text, "tier_hits": hits,
                                                      "stages": stage_row(delta(st0, st1), c.as_dict(), hits)})
                    if src == "G2":
                        # vLLM's own hit in this server, at once (paired): the G2 hit left the prompt in its cache.
                        # On a shared machine the vllm source's G1, timed minutes earlier, ran under another load.
                        st0 = read_stages(run.hooks)
                        c1 = await stream_completion(cli, server.model, words(p), o.max_tokens)
                        st1 = read_stages(run.hooks)
                        res["G1-kvbm"].setdefault(n, []).append(c1.as_dict() | {
                            "same_text": c1.text == first.text,
                            "stages": stage_row(delta(st0, st1), c1.as_dict(), None)})
            run.echo(f"    {n:>6} tokens: first {_p(res['first'][n])}, G2 {_p(res['G2'][n])}, G3 {_p(res['G3'][n])}"
                     f", G1 in this server {_p(res['G1-kvbm'][n])}")
        for i, s3c in enumerate(o.s3_clients):
            if i:  # the same blocks in S3, read by another client
                await asyncio.to_thread(daemon.start, g2=g2, g3=g3, s3_client=s3c)
                await after_restart(s3c)
            key = f"G4-{s3c}"
            res[key] = {}
            for n, prompts in run.lengths.items():
                res[key][n] = []
                for p, first in zip(prompts, res["first"][n], strict=True):
                    await asyncio.to_thread(server.reset_prefix_cache)
                    await asyncio.to_thread(daemon.wait_quiet)
                    await asyncio.to_thread(daemon.evict, ["G2", "G3"])
                    before = tier_counters(await asyncio.to_thread(daemon.stats))
                    st0 = read_stages(run.hooks)
                    c = await stream_completion(cli, server.model, words(p), o.max_tokens)
                    st1 = read_stages(run.hooks)
                    after = tier_counters(await asyncio.to_thread(daemon.stats))
                    hits = _hits(before, after)
                    res[key][n].append(c.as_dict() | {"same_text": c.text == first["text"], "tier_hits": hits,
                                                      "stages": stage_row(delta(st0, st1), c.as_dict(), hits)})
                run.echo(f"    {n:>6} tokens: {key} {_p(res[key][n])}")
        return res
    finally:
        await cli.close()


def _hits(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {t: after[t]["hits"] - before[t]["hits"] for t in ("G2", "G3", "G4") if t in after and t in before}


async def multi_turn(run: Run, server: VllmServer, reset: bool) -> list[list[dict[str, Any]]]:
    """Sessions whose every turn re-sends the history plus a new question; ``reset``: vLLM's own cache is
    emptied before each turn (other traffic evicted it), so only an external cache can serve the history."""
    o = run.o
    cli = client(server, o.request_timeout_s)
    out: list[list[dict[str, Any]]] = []
    try:
        for qs in run.turns:
            history: list[int] = []
            turns = []
            for q in qs:
                history = history + q
                if reset:
                    await asyncio.to_thread(server.reset_prefix_cache)
                c = await stream_completion(cli, server.model, words(history), o.max_tokens)
                turns.append(c.as_dict())
                # The answer joins the history as the tokens it decodes to (special tokens print nothing).
                history = history + [int(w[1:]) for w in c.text.split() if re.fullmatch(r"w\d+", w)]
            out.append(turns)
        return out
    finally:
        await cli.close()



async def peer_attempt(run: Run, name: str) -> dict[str, Any]:
    """Start the peer's server and send one prompt twice (cache emptied between): what happened, with the
    exact error when it did not work."""
    o = run.o
    env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1.0"} \
        if name == "lmcache" else {}
    srv = run.server(name, PEER_CONNECTORS[name], env=env, python=o.peer_python)
    srv.start_timeout_s = 600
    res: dict[str, Any] = {"connector": PEER_CONNECTORS[name], "python": srv.cmd[0]}
    try:
        await asyncio.to_thread(srv.start)
    except RuntimeError as e:
        res.update(status="refused", error=error_line(str(e)), startup="failed")
        run.keep_log(srv.log_path, f"vllm-{name}.log")
        return res
    try:
        cli = client(srv, 120)
        n = min(o.lengths) if o.lengths else o.doc_tokens
        p = Prompts(o.vocab, o.seed + 99).ids(n)
        first = await stream_completion(cli, srv.model, words(p), o.max_tokens)
        await asyncio.to_thread(srv.reset_prefix_cache)
        second = await stream_completion(cli, srv.model, words(p), o.max_tokens)
        await cli.close()
        res.update(first=first.as_dict(), second=second.as_dict())
        log = srv.log_tail(200_000)
        if (second.cached_tokens or 0) > 0 and second.error is None:
            res["status"] = "ran"
        else:
            res.update(status="refused", error=error_line(log) or "served without caching (0 cached tokens)")
        return res
    finally:
        await asyncio.to_thread(srv.stop)
        run.keep_log(srv.log_path, f"vllm-{name}.log")

