"""``kvbm bench native``: kvbm's tier against vLLM's own ``fs`` tier, each the one secondary tier of vLLM's
real ``TieringOffloadingManager`` (CPU primary tier), in the same run, on the same disk.

Per repeat and tier (interleaved): one engine stores ``chunks`` chunks (the primary rows are written first,
untimed: that is the GPU worker's DMA); **store** is the time from ``complete_store`` until the tier reported
every cascade job. The engine is shut down and a new one started (an engine restart: vLLM's CPU tier is
gone); **lookup** is vLLM's own per-chunk figure (``lookup_async_delay``: first RETRY to resolution) and the
wall time until no chunk is RETRY; **load** is the time from there until every chunk is a primary HIT
(the promotions). Every loaded row is checked byte for byte (untimed). Then what survives: another engine
started next to it, and (kvbm) the daemon restarted: its G2 is gone, its disk tier (G3) is re-read.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbm.bench.common import DaemonProc, machine, median, temp_dir
from kvbm.bench.native import KVBM_TIER, NativeEngine, chunk_bytes_of, chunk_keys, offloading_config
from kvbm.bench.report import table
from kvbm.daemon.launch import ipc_endpoint

GB = 1_000_000_000


@dataclass
class NativeOptions:
    chunk_bytes: int = 256 * 1024
    chunks: int = 256
    repeats: int = 3
    workdir: str | None = None
    tiers: tuple[str, ...] = ("kvbm", "fs")


def _daemon_cfg(root: Path, opts: NativeOptions) -> dict[str, Any]:
    g2 = 4 * opts.chunks * opts.chunk_bytes  # a pass's chunks, their pins and the next pass's, never evicted
    return {"block_bytes": opts.chunk_bytes, "device": {"enabled": False}, "host": {"capacity": g2},
            "disk": {"enabled": True, "dir": str(root / "g3"), "capacity": 4 * g2, "fsync": False},
            "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": ipc_endpoint(root, "kvbm.sock"), "events_endpoint": ipc_endpoint(root, "ev.sock"),
                       "metrics_port": -1}}


def _cfg(tier: dict[str, Any], opts: NativeOptions) -> Any:
    """A new engine's config (a new engine id) with ``tier`` its one secondary tier, room for two passes."""
    return offloading_config([tier], chunk_bytes=opts.chunk_bytes, cpu_bytes=2 * opts.chunks * opts.chunk_bytes,
                             events=False)


def _pass(tier: dict[str, Any], label: str, keys: list[bytes], opts: NativeOptions) -> dict[str, Any]:
    eng = NativeEngine(_cfg(tier, opts))
    try:
        nbytes = len(keys) * eng.row_bytes
        assert eng.store(keys) == len(keys)
        store_s = eng.settle()
        failed = _counter(eng.stats(), "vllm:kv_offload_tiering_cascade_job_failures")
    finally:
        eng.shutdown()
    out = {"store_s": store_s, "store_GBps": nbytes / store_s / GB, "store_failures": failed}
    out.update(_restart(_cfg(tier, opts), keys, label, "engine_restart"))
    return out


def _restart(cfg: Any, keys: list[bytes], label: str, what: str) -> dict[str, Any]:
    """A new engine looks ``keys`` up and loads them: the figures, and the fraction that were hits."""
    eng = NativeEngine(cfg)
    try:
        lookup_s, load_s, results = _lookup_and_load(eng, keys)
        hits = sum(r == "HIT" for r in results)
        if hits:
            exact = [k for k, r in zip(keys, results, strict=True) if r == "HIT"]
            got = eng.read(exact)
            bad = sum(not (g == chunk_bytes_of(k, eng.row_bytes)).all() for g, k in zip(got, exact, strict=True))
            if bad:
                raise AssertionError(f"{label}: {bad} chunks loaded with other bytes than were stored")
        eng.finish()
        stats = eng.stats()
        n = _counter(stats, "vllm:kv_offload_tiering_lookup_async_delay_seconds", "_count")
        s = _counter(stats, "vllm:kv_offload_tiering_lookup_async_delay_seconds", "_sum")
        nbytes = hits * eng.row_bytes
        return {f"{what}_hit": hits / len(keys), f"{what}_lookup_wall_ms": lookup_s * 1000,
                f"{what}_lookup_ms_per_chunk": (s / n * 1000) if n else None,
                f"{what}_load_s": load_s, f"{what}_load_GBps": nbytes / load_s / GB if hits and load_s else None}
    finally:
        eng.shutdown()


def _lookup_and_load(eng: NativeEngine, keys: list[bytes], timeout_s: float = 120.0) -> tuple[float, float, list[str]]:
    """vLLM's scheduler loop over ``keys``: seconds until no chunk is RETRY, then until none is pending."""
    ctx = eng._ctx()
    eng._open = ctx
    t0 = time.monotonic()
    resolved: float | None = None
    while True:
        res = [eng.manager.lookup(k, ctx).name for k in keys]
        now = time.monotonic()
        if resolved is None and "RETRY" not in res:
            resolved = now
        if "RETRY" not in res and "HIT_PENDING" not in res:
            return resolved - t0, now - resolved, res
        if now - t0 > timeout_s:
            raise TimeoutError(f"lookups unresolved after {timeout_s} s: {sorted(set(res))}")
        eng.step()
        time.sleep(0.0002)


def _restart_daemon(daemon: DaemonProc) -> None:
    """Stop and start the daemon; ready when this start logged ``daemon.started`` (the log is appended to)."""
    daemon.stop()
    daemon.start()


def _counter(stats: dict[str, Any], name: str, suffix: str = "") -> float:
    return float(sum(v for k, v in stats.items() if k.startswith(name) and k.endswith(suffix)))


def run_native(opts: NativeOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in opts.tiers}
    with temp_dir("kvbm-bench-native-", opts.workdir) as root:
        daemon = DaemonProc(root / "daemon", _daemon_cfg(root / "daemon", opts))
        daemon.start()
        try:
            tiers = {"kvbm": {**KVBM_TIER, "daemon": daemon.endpoint, "timeout_s": 30.0},
                     "fs": {"type": "fs", "root_dir": str(root / "fs")}}
            for rep in range(opts.repeats):
                for name in opts.tiers:
                    keys = chunk_keys(opts.chunks, f"{name}-{rep}")
                    r = _pass(tiers[name], name, keys, opts)
                    # Another engine on the node, while nothing else runs: does it see them?
                    r.update(_restart(_cfg(tiers[name], opts), keys, name, "other_engine"))
                    if name == "kvbm":
                        _restart_daemon(daemon)
                        r.update(_restart(_cfg(tiers[name], opts), keys, name, "daemon_restart"))
                    rows[name].append(r)
                    load = r["engine_restart_load_GBps"] or 0.0
                    echo(f"{name} #{rep}: store {r['store_GBps']:.2f} GB/s, load {load:.2f} GB/s, "
                         f"lookup {r['engine_restart_lookup_wall_ms']:.1f} ms")
                if "fs" in opts.tiers:
                    shutil.rmtree(root / "fs", ignore_errors=True)
        finally:
            daemon.stop()
    summary = []
    for name, rs in rows.items():
        med: dict[str, Any] = {"tier": name, "repeats": len(rs)}
        for key in rs[0]:
            vals = [r[key] for r in rs if r.get(key) is not None]
            med[key] = median(vals) if vals else None
        summary.append(med)
    return {"bench": "native", "machine": machine(), "options": asdict(opts), "rows": summary, "passes": rows,
            "notes": ["store: from complete_store until every cascade job was reported (kvbm: committed to G2, "
                      "the daemon's host pool, G3 written behind; fs: files written, page cache, no fsync)",
                      "engine_restart: a new TieringOffloadingManager (vLLM's CPU tier empty) loading every chunk",
                      "daemon_restart: kvbm's daemon stopped and started (G2 lost, G3 re-read) before a new engine"]}


HEADERS = ("tier", "store GB/s", "load GB/s", "lookup ms/chunk", "lookup wall ms", "hit: engine restart",
           "hit: other engine", "hit: daemon restart", "load GB/s after daemon restart")


def native_table(report: dict[str, Any], markdown: bool = False) -> str:
    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    rows = [[r["tier"], f(r["store_GBps"]), f(r.get("engine_restart_load_GBps")),
             f(r.get("engine_restart_lookup_ms_per_chunk"), 3), f(r.get("engine_restart_lookup_wall_ms"), 1),
             f(r.get("engine_restart_hit")), f(r.get("other_engine_hit")), f(r.get("daemon_restart_hit")),
             f(r.get("daemon_restart_load_GBps"))] for r in report["rows"]]
    return table(HEADERS, rows, markdown)
