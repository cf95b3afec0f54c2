"""``kvbm bench long-doc-qa --engine vllm``: TTFT of a real vLLM (CPU build) with KvbmConnector, recompute vs
prefix hits from G2, G3 and G4 alone, at each TP size, and where a hit's time goes.

The bench writes a random Llama (sizes as options), starts SeaweedFS (or uses ``--s3-endpoint``) and, per TP
size, a ``kvbm serve`` daemon with G2, G3 and G4 whose ``block_bytes`` is ``k`` vLLM blocks of one rank, then
runs the engine in its own process (:mod:`kvbm.bench.longdoc_vllm_runner`). Per hit source it reports the
median TTFT and three parts:

* ``a`` moving the bytes: the hit's bytes at that tier's bandwidth, measured in the same run on the same
  blocks (G2: memcpy; G3: reads of the block files, page cache dropped; G4: GETs of the objects);
* ``b`` prefilling the uncached tail: the TTFT when vLLM's own prefix cache holds exactly the blocks kvbm
  would load (the same tail attends over the same cached prefix; nothing is moved), the ``G1`` row;
* ``c`` the rest (lookup, scheduling, the daemon's onboard beyond the raw read, the copy into vLLM's cache).

``ratio = TTFT / (a + b)``: the goal is at most 1.2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbm.bench.common import BenchTarget, DaemonProc, load_avg, summary
from kvbm.bench.runner import BenchRun

MiB = 1024 * 1024
VLLM_BLOCK = 128  # tokens per vLLM block (the CPU backend's default)
GOAL = 1.2
SOURCES = ("recompute", "tail", "G1", "G2", "G3", "G4")


@dataclass
class VllmLongDocOptions(BenchTarget):
    doc_lengths: tuple[int, ...] = (4000,)
    docs: int = 1
    queries: int = 3  # timed requests per source (the median is reported)
    query_tokens: int = 32
    tp: tuple[int, ...] = (1, 2)
    layers: int = 8
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 8192
    vllm_blocks_per_kvbm_block: int = 2
    s3_threads: int = 8  # GETs in flight measuring G4's bandwidth
    disk_threads: int = 4  # reads in flight measuring G3's bandwidth
    bw_repeats: int = 3
    seed: int = 0
    sources: tuple[str, ...] = SOURCES
    connector: dict[str, Any] = field(default_factory=dict)  # extra kv_connector_extra_config keys
    logs: str | None = None  # copy each engine's and daemon's log here
    request_timeout_s: float = 300.0  # a timed request running longer stops that engine (reported as stalled)
    cpu_bind: str = "rank"  # TP>1: "rank" pins rank r to core r (VLLM_CPU_OMP_THREADS_BIND="0|1"); "shared": all cores

    def check(self) -> None:
        _check(self)

    @property
    def max_model_len(self) -> int:
        """The longest prompt (document + question) in whole vLLM blocks, plus one block to spare."""
        return (max(self.doc_lengths) + self.query_tokens + 2 * VLLM_BLOCK) // VLLM_BLOCK * VLLM_BLOCK

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def bytes_per_token(self, tp: int) -> int:
        """KV bytes per token on one rank (bf16, K and V)."""
        return self.layers * 2 * (self.kv_heads // tp) * self.head_dim * 2


def write_random_llama(path: Path, o: VllmLongDocOptions) -> str:
    """A random-weight Llama (bf16) saved where vLLM can load it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(o.seed)
    cfg = LlamaConfig(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=o.intermediate,
                      num_hidden_layers=o.layers, num_attention_heads=o.heads, num_key_value_heads=o.kv_heads,
                      max_position_embeddings=o.max_model_len, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(o: VllmLongDocOptions) -> None:
    """Sizes that fit together (a clear error before anything starts)."""
    if o.hidden % o.heads or o.heads % o.kv_heads:
        raise ValueError(f"hidden {o.hidden}, heads {o.heads}, kv heads {o.kv_heads} do not divide")
    for tp in o.tp:
        if tp < 1 or o.kv_heads % tp:
            raise ValueError(f"TP {tp} does not divide {o.kv_heads} KV heads")
    bad = set(o.sources) - set(SOURCES)
    if bad:
        raise ValueError(f"unknown sources {sorted(bad)} (the vllm engine knows {', '.join(SOURCES)})")
    bt = VLLM_BLOCK * o.vllm_blocks_per_kvbm_block
    if min(o.doc_lengths) + o.query_tokens - 1 < bt:
        raise ValueError(f"a document of {min(o.doc_lengths)} tokens holds no full kvbm block of {bt} tokens")


async def run_longdoc_vllm(o: VllmLongDocOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole bench (async only to match the other engines' entry points: the work is in subprocesses)."""
    import asyncio

    return await asyncio.to_thread(_run, o, echo)


def _run(o: VllmLongDocOptions, echo: Callable[[str], None]) -> dict[str, Any]:
    _check(o)
    bt = VLLM_BLOCK * o.vllm_blocks_per_kvbm_block
    rows: list[dict[str, Any]] = []
    bench = BenchRun(
        "long-doc-qa", o, echo, engine="vllm", rows=rows,
        model={"layers": o.layers, "hidden": o.hidden, "heads": o.heads, "kv_heads": o.kv_heads,
               "intermediate": o.intermediate, "vocab": o.vocab, "dtype": "bfloat16", "kind": "random Llama"},
        kvbm_block_tokens=bt, goal_ratio=GOAL, runs={})
    report = bench.report
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        report["machine"]["vllm"] = version("vllm-cpu")  # under this name, not the package's (the report's readers)
    echo(f"kvbm bench long-doc-qa --engine vllm: random Llama {o.layers}L/{o.hidden}H/{o.heads} heads/"
         f"{o.kv_heads} KV heads, {','.join(map(str, o.doc_lengths))}-token documents + "
         f"{o.query_tokens}-token question, "
         f"{bt} tokens per kvbm block, TP {','.join(map(str, o.tp))}, {o.queries} queries per source; "
         f"load {load_avg()}")
    with bench:
        work, srv = bench.work, bench.srv
        assert srv is not None
        t = time.perf_counter()
        model = write_random_llama(work / "model", o)
        echo(f"  model written in {time.perf_counter() - t:.1f}s")
        for tp in o.tp:
            run = _one_tp(o, tp, model, srv, work / f"tp{tp}", echo)
            report["runs"][f"tp{tp}"] = run
            for r in rows_of(tp, run):
                rows.append(r)
                echo("    " + describe_row(r))
    return report


def _one_tp(o: VllmLongDocOptions, tp: int, model: str, srv: dict[str, Any], root: Path,
            echo: Callable[[str], None]) -> dict[str, Any]:
    bt = VLLM_BLOCK * o.vllm_blocks_per_kvbm_block
    block_bytes = bt * o.bytes_per_token(tp)
    full = (max(o.doc_lengths) + o.query_tokens - 1) // bt
    # Every block the run stores fits in G2 (warm documents + one fresh document per recompute query).
    g2_blocks = (o.docs + o.queries + 2) * full * tp
    prefix = f"{srv['prefix']}/tp{tp}"
    cfg: dict[str, Any] = {
        "block_bytes": block_bytes,
        "device": {"enabled": False},
        "host": {"capacity": g2_blocks * block_bytes},
        "disk": {"dir": str(root / "g3"), "capacity": 2 * g2_blocks * block_bytes + (64 << 20), "fsync": False},
        "s3": {"endpoint": srv["endpoint"], "access_key": srv["access_key"], "secret_key": srv["secret_key"],
               "bucket": srv["bucket"], "prefix": prefix, "max_pending_writes": max(64, g2_blocks)},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"tcp://127.0.0.1:{_free_port()}", "events_endpoint": f"tcp://127.0.0.1:{_free_port()}",
                   "metrics_port": 0, "admin_token_file": str(root / "admin.token")},
    }
    daemon = DaemonProc(root, cfg, name=f"tp{tp}")
    spec = {
        "model": model, "model_name": f"kvbm-bench/random-llama-{o.layers}x{o.hidden}", "tp": tp,
        "doc_lengths": list(o.doc_lengths), "query_tokens": o.query_tokens, "docs": o.docs, "queries": o.queries,
        "vocab": o.vocab, "seed": o.seed + tp, "kvbm_block_tokens": bt, "block_bytes": block_bytes,
        "max_model_len": o.max_model_len,
        "sources": [s for s in SOURCES if s in o.sources], "daemon": cfg["daemon"]["endpoint"],
        "admin_token_file": cfg["daemon"]["admin_token_file"], "disk_dir": cfg["disk"]["dir"],
        "s3": {k: srv[k] for k in ("endpoint", "access_key", "secret_key", "bucket")} | {"prefix": prefix},
        "s3_threads": o.s3_threads, "disk_threads": o.disk_threads, "bw_repeats": o.bw_repeats,
        "connector": o.connector, "request_timeout_s": o.request_timeout_s,
    }
    spec_path, out_path, log_path = root / "spec.json", root / "out.json", root / "engine.log"
    echo(f"  TP={tp}: daemon block_bytes {block_bytes / MiB:g} MiB ({bt} tokens, one rank), {full} blocks per "
         f"document per rank (longest)")
    try:
        daemon.start()
        spec["daemon_pid"] = daemon.proc.pid
        fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the S3 secret
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_", "AWS_"))}
        env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))})
        if tp > 1:
            ncpu = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                f"0-{ncpu - 1}" if o.cpu_bind == "shared" else str(r % ncpu) for r in range(tp))
        t = time.perf_counter()
        rc = _run_engine([sys.executable, "-m", "kvbm.bench.longdoc_vllm_runner", str(spec_path), str(out_path)],
                         env, log_path)
        run = json.loads(out_path.read_text()) if out_path.exists() else {"lengths": []}
        if rc != 0:
            tail = log_path.read_text(errors="replace")[-3000:]
            if "stalled" not in run:
                raise RuntimeError(f"the vLLM engine (TP={tp}) failed (exit {rc}):\n{tail}")
            st = run["stalled"]
            echo(f"    STALLED: {st['source']} query {st['query']} ({st['doc_tokens']} tokens) still running after "
                 f"{st['after_s']}s; engine stopped (the report's runs.tp{tp}.stalled"
                 f"{', logs in ' + o.logs if o.logs else ''})")
        run["engine_s"] = round(time.perf_counter() - t, 1)
        run["block_bytes"] = block_bytes
        run["daemon_pid"] = daemon.proc.pid
        run["env"] = {k: env[k] for k in ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING",
                                          "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND") if k in env}
        run["load_avg"] = load_avg()
        return run
    finally:
        daemon.stop()
        spec_path.unlink(missing_ok=True)
        if o.logs:
            Path(o.logs).mkdir(parents=True, exist_ok=True)
            for f in (log_path, daemon.log_path):
                if f.exists():
                    shutil.copyfile(f, Path(o.logs) / f"tp{tp}-{f.name}")


def _run_engine(cmd: list[str], env: dict[str, str], log_path: Path) -> int:
    """Run the engine in a session of its own and, however this ends (an error, Ctrl-C), leave none of its
    processes behind: vLLM's TP workers outlive a killed parent."""
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc = None
        try:
            rc = proc.wait()
            return rc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the workers of an engine that exited are gone already
            proc.wait()
            if rc != 0:
                _remove_orphan_shm(started)


def _remove_orphan_shm(since: float, pattern: str = "psm_*") -> None:
    """A killed vLLM leaves its TP message queues (``/dev/shm/psm_*``, hundreds of MiB each) behind: remove
    those created since ``since`` that no process maps any more."""
    shm = Path("/dev/shm")
    cands = [f for f in shm.glob(pattern) if f.stat().st_mtime >= since] if shm.is_dir() else []
    if not cands:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(ln.rsplit(" ", 1)[-1].strip() for ln in maps.read_text().splitlines() if "/dev/shm/" in ln)
    for f in cands:
        if str(f) not in mapped:
            with contextlib.suppress(OSError):
                f.unlink()


def rows_of(tp: int, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of one engine run: per document length and source, the TTFT summary; for hits the parts a (bytes /
    the tier's bandwidth), b (the G1 reference's median TTFT), c (the rest) and the ratio TTFT / (a + b)."""
    rows = []
    for ln in run["lengths"]:
        by: dict[str, list[dict[str, Any]]] = {}
        for r in ln["runs"]:
            by.setdefault(r["source"], []).append(r)
        med = {s: statistics.median(x["ttft_s"] for x in rs) for s, rs in by.items()}
        per_doc_bytes = ln["blocks_per_doc"] * run["block_bytes"]
        b = med.get("G1")
        for source in SOURCES:
            if source not in by:
                continue
            rs = by[source]
            row: dict[str, Any] = {"tp": tp, "doc_tokens": ln["doc_tokens"], "source": source,
                                   "ttft_ms": summary([x["ttft_s"] * 1e3 for x in rs]),
                                   "prompt_tokens": rs[0]["prompt_tokens"], "cached_tokens": rs[0]["cached_tokens"]}
            waits = [x["engine_wait_s"] for x in rs if "engine_wait_s" in x]
            if waits:  # vLLM's own timestamps: waiting to be scheduled (a hit's async load), then the prefill step
                row["engine_ms"] = {"wait": round(statistics.median(waits) * 1e3, 2),
                                    "prefill": round(statistics.median(x["engine_prefill_s"] for x in rs) * 1e3, 2)}
            if "recompute" in med:
                row["speedup"] = round(med["recompute"] / med[source], 2)
            if source in ("G2", "G3", "G4"):
                mbps = ln["bandwidth"][source]["MBps"]
                a, ttft = per_doc_bytes / (mbps * 1e6), med[source]
                row.update(bytes=per_doc_bytes, tier_MBps=mbps,
                           daemon_onboard_ms=round(statistics.median(x["daemon_onboard_s"] for x in rs) * 1e3, 2))
                row["parts_ms"] = {"a_move": round(a * 1e3, 2), "b_tail_prefill": round(b * 1e3, 2) if b else None,
                                   "c_rest": round((ttft - a - b) * 1e3, 2) if b else None}
                row["ratio"] = round(ttft / (a + b), 3) if b else None
                row["meets_goal"] = bool(b) and ttft / (a + b) <= GOAL
                if "G1" in by:  # the same prompts as the G1 reference: the same first tokens
                    row["same_tokens_as_G1"] = [x["tokens"] for x in rs] == [x["tokens"] for x in by["G1"]]
            rows.append(row)
    st = run.get("stalled")
    if st:  # the request that never finished: no TTFT, how long it ran before the engine was stopped
        rows.append({"tp": tp, "doc_tokens": st["doc_tokens"], "source": st["source"], "stalled_after_s": st["after_s"],
                     "ttft_ms": None})
    return rows


def describe_row(r: dict[str, Any]) -> str:
    t = r["ttft_ms"]
    if t is None:
        return f"TP={r['tp']} {r['doc_tokens']:>6} tokens {r['source']:<9} STALLED (> {r['stalled_after_s']} s)"
    s = (f"TP={r['tp']} {r['doc_tokens']:>6} tokens {r['source']:<9} TTFT p50 {t['p50']:8.1f} ms "
         f"(n {t['n']}, min {t['min']:.1f}, max {t['max']:.1f})")
    if "engine_ms" in r:
        s += f"  [engine: wait {r['engine_ms']['wait']:.1f}, prefill {r['engine_ms']['prefill']:.1f}]"
    if "parts_ms" in r:
        p = r["parts_ms"]
        s += (f"  a {p['a_move']:.1f} ({r['tier_MBps']:,.0f} MB/s) + b {p['b_tail_prefill']:.1f} + c "
              f"{p['c_rest']:.1f} ms; ratio {r['ratio']:.2f} (goal <= {GOAL}); daemon onboard "
              f"{r['daemon_onboard_ms']:.1f} ms")
    return s
