"""``kvbm bench trace``: replay a Mooncake-format trace through a real ``kvbm serve`` daemon.

Each request is started at its timestamp divided by ``speedup`` (at most ``inflight`` at once): a Lookup of its
``hash_ids`` prefix, an Onboard (load) of the hit, every loaded byte compared with what was stored, then a store of
the rest. A block's bytes are a function of its id alone, so a block served from any tier is checked exactly.
Per run (G2+G3 capacity as a share of the trace's distinct blocks, S3 off or on): hit ratio, the share of block
references served by each tier, bytes per tier, request latency p50/p90/p99 and the daemon's request rate; next to
them the same trace's LRU / Belady / infinite-cache hit ratios at the same capacity (:mod:`kvbm.bench.trace_sim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.common import (
    BenchTarget,
    DaemonProc,
    delete_prefix,
    load_avg,
    s3_server,
    summary,
)
from kvbm.bench.runner import BenchRun
from kvbm.bench.trace_sim import SHIPPED_TRACE, TraceRequest, bounds, load_trace, purge_cost, trace_summary
from kvbm.daemon.launch import ipc_endpoint, ipc_exists

KiB = 1024
FULL_RETRIES = 10
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: distinct ids give distinct words at every offset


@dataclass
class TraceOptions(BenchTarget):
    trace: str = str(SHIPPED_TRACE)  # a Mooncake-format JSONL file, .gz or not
    limit: int = 0  # first N requests (0: all)
    speedup: float = 20.0  # timestamps divided by this
    block_bytes: int = 32 * KiB
    capacities: tuple[float, ...] = (0.01, 0.03)  # G2+G3 blocks as a share of the trace's distinct blocks
    g2_share: float = 0.25  # of G2+G3, G2's part
    s3_modes: tuple[str, ...] = ("off",)  # off, on
    inflight: int = 8
    evictions: tuple[str, ...] = ("lru",)  # the daemon's policy.eviction, one run each
    g3_dir: str = ""  # where G3 lives (default: the workdir); a tmpfs takes the disk's latency out
    seed: int = 0
    daemon_overrides: dict[str, Any] = field(default_factory=dict)  # merged into the daemon's "daemon" config

    def check(self) -> None:
        if not self.trace:
            raise ValueError("--trace: a Mooncake-format JSONL file is required")
        if self.speedup <= 0:
            raise ValueError("--speedup must be > 0")
        if self.block_bytes < 64 or self.block_bytes % 8:
            raise ValueError("--block-size must be a multiple of 8 bytes, >= 64")
        if not self.capacities or any(not 0 < c <= 1 for c in self.capacities):
            raise ValueError("--capacities: shares of the distinct blocks in (0, 1]")
        if not 0 < self.g2_share < 1:
            raise ValueError("--g2-share must be in (0, 1)")
        if bad := [m for m in self.s3_modes if m not in ("off", "on")]:
            raise ValueError(f"--s3: off and/or on, not {bad}")
        if bad := [e for e in self.evictions if e not in ("lru", "frequency")]:
            raise ValueError(f"--eviction: lru and/or frequency, not {bad}")
        if self.inflight < 1:
            raise ValueError("--inflight must be >= 1")


class Blocks:
    """The bytes of block ``id``: a random base XORed with ``id * odd constant`` (every byte depends on the id)."""

    def __init__(self, block_bytes: int, seed: int) -> None:
        self.words = block_bytes // 8
        self.base = np.random.default_rng(seed).integers(0, 2**63, size=self.words, dtype=np.uint64)

    def make(self, ids: Sequence[int]) -> np.ndarray:
        """A (len(ids), block_bytes) uint8 array."""
        mix = np.asarray(ids, dtype=np.uint64)[:, None] * _MIX
        return (self.base[None, :] ^ mix).view(np.uint8)


def _key_hash(h: int) -> bytes:
    return h.to_bytes(16, "big")


@dataclass
class RunStats:
    refs: int = 0
    hits: int = 0
    matched: int = 0  # blocks the lookups reported (a load may bring fewer)
    by_tier: Counter[str] = field(default_factory=Counter)
    stored: int = 0
    store_requested: int = 0
    verified: int = 0
    wrong: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latency: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)  # start - scheduled arrival
    full_retries: int = 0


async def _request(c: Any, ns: str, r: TraceRequest, blocks: Blocks, st: RunStats, chunk: int) -> None:
    from kvbm.blocks import BlockKey
    from kvbm.client import DaemonError, Overloaded

    keys = [BlockKey(ns, _key_hash(h)) for h in r.hash_ids]
    st.refs += len(keys)
    got = 0
    try:
        rep = await c.lookup(keys)
        st.matched += rep.matched
        if rep.matched:
            outs = np.zeros((rep.matched, blocks.words * 8), np.uint8)
            # Loaded in runs that fit G2 next to the other requests in flight (an Onboard pins what it brings up),
            # as the connector bounds its pipelined Onboards.
            for a in range(0, rep.matched, chunk):
                b = min(rep.matched, a + chunk)
                n = await c.load(keys[a:b], list(outs[a:b]))
                got += n
                if n < b - a:
                    break
            if got:
                want = blocks.make(r.hash_ids[:got])
                ok = np.all(outs[:got] == want, axis=1)
                st.verified += int(ok.sum())
                st.wrong += int((~ok).sum())
                # The lookup's tier of each block: the tier it was served from (an Onboard brings it up from there).
                st.by_tier.update(rep.tiers[:got])
                st.hits += got
        rest = r.hash_ids[got:]
        if rest:
            st.store_requested += len(rest)
            bufs = list(blocks.make(rest))
            for attempt in range(FULL_RETRIES + 1):
                try:
                    ack = await c.store(keys[got:], bufs)
                    break
                except DaemonError as e:
                    # G2 taken by the other requests' pins and reservations right now: they end within ms.
                    if e.code != "full" or attempt == FULL_RETRIES:
                        raise
                    st.full_retries += 1
                    await asyncio.sleep(0.02 * (attempt + 1))
            st.stored += ack.stored
    except Overloaded:
        st.errors["shed"] += 1
    except DaemonError as e:
        st.errors[e.code] += 1
        if st.errors[e.code] <= 3:
            st.errors[f"{e.code}: {e.message[:160]}"] += 1


async def replay(endpoint: str, reqs: Sequence[TraceRequest], opts: TraceOptions, blocks: Blocks,
                 say: Callable[[str], None]) -> tuple[RunStats, float, dict[str, Any]]:
    """Replay ``reqs`` against the daemon at ``endpoint``; returns the figures, the wall time and its stats."""
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import AsyncWorkerClient

    layout = KVLayout(model="bench-trace", num_layers=1, num_kv_heads=1, head_size=opts.block_bytes // 2,
                      dtype="uint8", kv_factor=2, tokens_per_block=1, block_bytes=opts.block_bytes)
    st = RunStats()
    gate = asyncio.Semaphore(opts.inflight)
    async with AsyncWorkerClient(endpoint, timeout_s=120.0) as c:
        await c.register(layout, worker_id="bench-trace")
        ns = c.namespace
        reg = c.registered
        chunk = max(1, reg.capacity_bytes // reg.slot_bytes // (2 * opts.inflight))
        t0 = time.perf_counter()
        ts0 = reqs[0].timestamp_ms if reqs else 0
        tasks: list[asyncio.Task[None]] = []
        next_say = t0 + 10.0

        async def one(r: TraceRequest, due: float) -> None:
            async with gate:
                start = time.perf_counter()
                st.lag.append(max(0.0, start - due))
                await _request(c, ns, r, blocks, st, chunk)
                st.latency.append(time.perf_counter() - start)

        for i, r in enumerate(reqs):
            due = t0 + (r.timestamp_ms - ts0) / 1e3 / opts.speedup
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(one(r, due)))
            if time.perf_counter() >= next_say:
                next_say += 10.0
                say(f"  {i + 1}/{len(reqs)} requests, hit {st.hits / max(1, st.refs):.3f}, "
                    f"{sum(v for k, v in st.errors.items() if ':' not in k)} errors")
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        stats = await c.stats()
    return st, wall, stats


def _daemon_cfg(root: Path, o: TraceOptions, g2_blocks: int, g3_blocks: int, srv: dict[str, Any] | None,
                tag: str, eviction: str) -> dict[str, Any]:
    from kvbm.blocks import ALIGNED_HEADER_LEN
    from kvbm.transfer.aligned import round_up

    cfg: dict[str, Any] = {
        "block_bytes": o.block_bytes, "device": {"enabled": False},
        "host": {"capacity": g2_blocks * o.block_bytes, "pin": False},
        "disk": {"dir": str(Path(o.g3_dir) / tag if o.g3_dir else root / "g3"), "o_direct": not o.g3_dir,
                 "capacity": g3_blocks * (ALIGNED_HEADER_LEN + round_up(o.block_bytes)), "fsync": False},
        "policy": {"eviction": eviction},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": ipc_endpoint(root, "kvbm.sock"), "events_endpoint": ipc_endpoint(root, "events.sock"),
                   "metrics_port": 0, "access_log_interval_s": 0, "max_inflight": 4096, "max_queue": 4096,
                   "admin_token_file": str(root / "admin.token"), **o.daemon_overrides},
    }
    if srv is not None:
        cfg["s3"] = {"endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": f"{srv['prefix']}/{tag}",
                     "access_key": srv["access_key"], "secret_key": srv["secret_key"], "max_pending_writes": 65536}
    return cfg


def _tier_bytes(stats: dict[str, Any]) -> dict[str, Any]:
    """Per tier, what its own counters say: bytes in and out, puts, gets, deletes, blocks held at the end."""
    out: dict[str, Any] = {}
    for t in stats.get("tiers") or []:
        s = t.get("stats") or {}
        out[t.get("tier", "?")] = {"bytes_in": s.get("bytes_in", 0), "bytes_out": s.get("bytes_out", 0),
                                   "puts": s.get("puts", 0), "gets": s.get("gets", 0), "deletes": s.get("deletes", 0),
                                   "blocks_end": t.get("blocks"), "capacity_bytes": t.get("capacity_bytes")}
    return out


async def run_one(reqs: Sequence[TraceRequest], o: TraceOptions, share: float, distinct: int, s3: str,
                  root: Path, srv: dict[str, Any] | None, blocks: Blocks, say: Callable[[str], None],
                  eviction: str = "lru") -> dict[str, Any]:
    total = max(2, round(share * distinct))
    g2 = max(1, round(total * o.g2_share))
    g3 = max(1, total - g2)
    tag = f"c{share:g}-s3{s3}-{eviction}"
    d = DaemonProc(root / tag, _daemon_cfg(root / tag, o, g2, g3, srv, tag, eviction), name=tag,
                   args=("--log-level", "warning"))
    say(f"trace: capacity {share:g} of distinct ({g2} G2 + {g3} G3 blocks), S3 {s3}, eviction {eviction}: "
        f"replaying {len(reqs)} requests")
    try:
        d.start(marks=(), ready=ipc_exists(ipc_endpoint(root / tag, "kvbm.sock")))
        cpu0 = d.cpu()
        st, wall, stats = await replay(d.endpoint, reqs, o, blocks, say)
        cpu = d.cpu() - cpu0
    finally:
        d.stop()
    refs = max(1, st.refs)
    mgr = stats.get("manager") or {}
    dmn = stats.get("daemon") or {}
    served = {t: round(n / refs, 4) for t, n in sorted(st.by_tier.items())}
    fast = sum(n for t, n in st.by_tier.items() if t in ("G2", "G3"))
    row: dict[str, Any] = {
        "capacity_share": share, "capacity_blocks": total, "g2_blocks": g2, "g3_blocks": g3, "s3": s3,
        "eviction": eviction,
        "requests": len(reqs), "block_refs": st.refs, "hit_blocks": st.hits, "hit_ratio": round(st.hits / refs, 4),
        "served_share": served, "g2_g3_share": round(fast / refs, 4), "lookup_matched": st.matched,
        "bytes_served": {t: n * o.block_bytes for t, n in sorted(st.by_tier.items())},
        "bytes_stored": st.stored * o.block_bytes, "store_requested_blocks": st.store_requested,
        "stored_blocks": st.stored, "verified_blocks": st.verified, "wrong_blocks": st.wrong,
        "errors": dict(st.errors), "full_retries": st.full_retries, "wall_s": round(wall, 2),
        "latency_ms": {k: round(v * 1e3, 3) for k, v in summary(st.latency).items() if k != "n"},
        "lag_ms": {k: round(v * 1e3, 3) for k, v in summary(st.lag).items() if k in ("p50", "p99", "max")},
        # The daemon's own counters over the replay: requests answered, and KV events (stored/removed) published.
        "daemon_requests_per_s": round(int(dmn.get("requests", 0)) / wall, 1) if wall else 0.0,
        "daemon_events_per_s": round(int(dmn.get("events_published", 0)) / wall, 1) if wall else 0.0,
        "daemon_errors": dmn.get("errors") or {},
        "daemon_cpu_s": round(cpu, 2), "manager": {k: v for k, v in mgr.items() if isinstance(v, (int, float))},
        "tier_bytes": _tier_bytes(stats),
    }
    say(f"trace: {tag}: hit {row['hit_ratio']:.3f} (G2+G3 {row['g2_g3_share']:.3f}, {served}), "
        f"p50 {row['latency_ms']['p50']:.2f} ms p99 {row['latency_ms']['p99']:.2f} ms, {st.wrong} wrong, "
        f"errors {sum(v for k, v in st.errors.items() if ':' not in k)}, {wall:.0f} s")
    return row


async def run_trace(o: TraceOptions, say: Callable[[str], None]) -> dict[str, Any]:
    o.check()
    reqs = load_trace(o.trace, o.limit)
    if not reqs:
        raise ValueError(f"--trace: {o.trace} holds no requests")
    summ = trace_summary(reqs)
    distinct = summ["distinct_blocks"]
    caps = [max(2, round(s * distinct)) for s in o.capacities]
    say(f"trace: {summ['requests']} requests, {summ['block_refs']} block refs, {distinct} distinct blocks, "
        f"{summ['duration_s']:.0f} s (replayed x{o.speedup:g})")
    # S3 runs start their own endpoint (an S3-off run has none running beside it).
    bench = BenchRun("trace", o, say, s3=False, load_avg_start=load_avg(), trace=summ,
                     simulated=bounds(reqs, caps), purge=purge_cost(reqs), runs=[])
    report = bench.report
    pc = report["purge"]
    say(f"trace: a purge of the bucket to 10% halfway costs the second half {pc['none'] - pc['access']:.4f} of hit "
        f"ratio by last access, {pc['none'] - pc['value']:.4f} by value (no purge: {pc['none']:.4f})")
    blocks = Blocks(o.block_bytes, o.seed)
    with bench:
        root = bench.work
        for s3 in o.s3_modes:
            ctx = s3_server(root, endpoint=o.s3_endpoint, access_key=o.s3_access_key, secret_key=o.s3_secret_key,
                            bucket=o.s3_bucket) if s3 == "on" else None
            srv = ctx.__enter__() if ctx is not None else None
            try:
                for eviction in o.evictions:
                    for share in o.capacities:
                        report["runs"].append(await run_one(reqs, o, share, distinct, s3, root, srv, blocks, say,
                                                            eviction))
            finally:
                if ctx is not None:
                    if srv is not None:  # an existing endpoint keeps its bucket: leave nothing of the run in it
                        with contextlib.suppress(Exception):
                            delete_prefix(srv, srv["prefix"])
                    ctx.__exit__(None, None, None)
    return report


HEADERS = ("capacity", "blocks G2+G3", "S3", "eviction", "hit", "G2", "G3", "G4", "G2+G3", "LRU", "policy sim",
           "Belady", "infinite", "p50 ms", "p90 ms", "p99 ms", "daemon req/s", "events/s", "wrong", "errors")


def trace_table(report: dict[str, Any], markdown: bool = False) -> str:
    from kvbm.bench.report import table

    sim = {r["capacity_blocks"]: r for r in report["simulated"]["by_capacity"]}
    rows = []
    for r in report["runs"]:
        s = sim.get(r["capacity_blocks"], {})
        sh = r["served_share"]
        rows.append([f"{r['capacity_share']:g}", r["capacity_blocks"], r["s3"], r.get("eviction", "lru"),
                     f"{r['hit_ratio']:.3f}",
                     f"{sh.get('G2', 0):.3f}", f"{sh.get('G3', 0):.3f}", f"{sh.get('G4', 0):.3f}",
                     f"{r['g2_g3_share']:.3f}", f"{s.get('lru', 0):.3f}",
                     f"{s['policy']:.3f}" if "policy" in s else "-",
                     f"{s.get('belady', 0):.3f}", f"{report['simulated']['infinite']:.3f}",
                     f"{r['latency_ms']['p50']:.2f}", f"{r['latency_ms']['p90']:.2f}", f"{r['latency_ms']['p99']:.2f}",
                     f"{r['daemon_requests_per_s']:.0f}", f"{r['daemon_events_per_s']:.0f}", r["wrong_blocks"],
                     sum(v for k, v in r["errors"].items() if ":" not in k)])
    return table(HEADERS, rows, markdown)


def plot_trace(report: dict[str, Any], path: str) -> None:
    """Hit ratio vs capacity: the daemon's, stacked per tier (one bar per S3 mode), next to the simulated bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    caps = sorted({r["capacity_share"] for r in runs})
    modes = sorted({(r["s3"], r.get("eviction", "lru")) for r in runs}, key=lambda m: (m[1], m[0]))
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / max(1, len(modes))
    colors = {"G2": "#1f77b4", "G3": "#ff7f0e", "G4": "#2ca02c"}
    for j, m in enumerate(modes):
        bottom = np.zeros(len(caps))
        for tier in ("G2", "G3", "G4"):
            vals = np.array([next((r["served_share"].get(tier, 0.0) for r in runs
                                   if r["capacity_share"] == c and (r["s3"], r.get("eviction", "lru")) == m), 0.0)
                             for c in caps])
            if not vals.any():
                continue
            x = np.arange(len(caps)) + (j - (len(modes) - 1) / 2) * width
            ax.bar(x, vals, width * 0.9, bottom=bottom, color=colors[tier], alpha=0.55 if m[0] == "on" else 1.0,
                   hatch="//" if m[1] == "frequency" else None, label=f"{tier} (S3 {m[0]}, {m[1]})")
            bottom += vals
    sim = report["simulated"]["by_capacity"]
    xs = np.arange(len(caps))
    for name, style in (("lru", "k--"), ("policy", "m-."), ("belady", "r:")):
        ys = [next((s.get(name, 0.0) for s in sim if abs(s["capacity_blocks"] - r0) <= 1), 0.0)
              for r0 in [next(r["capacity_blocks"] for r in runs if r["capacity_share"] == c) for c in caps]]
        ax.plot(xs, ys, style, marker="o", label=f"{name} (simulated)")
    ax.axhline(report["simulated"]["infinite"], color="grey", lw=1, label="infinite cache")
    ax.set_xticks(xs, [f"{c:g}" for c in caps])
    ax.set_xlabel("G2+G3 capacity (share of the trace's distinct blocks)")
    ax.set_ylabel("hit ratio (hit blocks / block references)")
    ax.set_title(f"kvbm bench trace: {Path(report['options']['trace']).name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
