"""``kvbm bench manager``: the manager's bookkeeping costs.

* **ingest**: block events (a block stored in a tier) per second: through the daemon's socket
  (PrepareStore + copy into G2 shared memory + CommitStore, batched: one ``store()`` per batch, and one
  ``store()`` of many blocks that the client pipelines in requests of a batch each) when :mod:`kvbm.daemon` exists,
  and straight into ``manager.registry`` in-process (``registry.add`` and ``registry.remove``).
* **lookup**: ``manager.lookup`` (``registry.match_prefix``) latency for a fully held 1,000-block prefix
  with 1M blocks registered (in-process), and the same request through the daemon's socket after the
  daemon was filled to the same count (medians of per-round percentiles).
* **index memory** per registered block: the heap the registry keeps once the caller's keys are dropped
  (tracemalloc, every block in one tier and in two), and the RSS delta of the registration.
* **onboard overhead**: a full onboard of N blocks from G3 and from G4 minus (a) the tier's own reads of
  the same blocks at the same concurrency and (b) a raw transfer of the same bytes (pread / boto3 GET).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import mmap
import os
import secrets
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbm.bench.common import (
    MB,
    BenchTarget,
    CpuMeter,
    DaemonProc,
    boto3_client,
    delete_prefix,
    load_avg,
    machine,
    median,
    rnd_bytes,
    s3_server,
    summary,
    temp_dir,
)
from kvbm.blocks import BlockKey
from kvbm.config import Config
from kvbm.index.registry import Registry

MiB = 1024 * 1024


@dataclass
class ManagerOptions(BenchTarget):
    registered: int = 1_000_000
    prefix_blocks: int = 1000
    lookups: int = 1000
    daemon: str = "auto"  # auto: use kvbm.daemon when it exists; off
    daemon_events: int = 50_000
    daemon_batch: int = 64
    daemon_lookups: int = 500
    daemon_registered: int | None = None  # blocks registered in the daemon before its lookups (None: registered)
    onboard_blocks: int = 32
    block_bytes: int = 8 * MiB
    onboard_repeats: int = 3
    groups: tuple[str, ...] = ("ingest", "lookup", "memory", "daemon", "onboard")


TIERS = ["G1", "G2", "G3", "G4"]


def _keys(n: int, ns: str) -> list[BlockKey]:
    # 16-byte hashes like kvbm's BLAKE2b-128 chain hashes; os.urandom in one call is fast.
    raw = os.urandom(16 * n)
    return [BlockKey(ns, raw[i * 16 : (i + 1) * 16]) for i in range(n)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _blocks_of(stats: Any) -> int:
    """Blocks the daemon's Stats reply counts in its tiers (G2 only here)."""
    try:
        return sum(int(t["blocks"]) for t in stats["tiers"])
    except (KeyError, TypeError, ValueError):
        return -1


def _row(rows: list[dict[str, Any]], metric: str, via: str, value: float, unit: str, note: str = "",
         **extra: Any) -> None:
    rows.append({"metric": metric, "via": via, "value": value, "unit": unit, "note": note, **extra})


def _index_bytes_per_block(keys: list[BlockKey], tiers: list[str]) -> float:
    """Heap the registry keeps per block once the caller's keys are gone (tracemalloc).

    Each block is added from a fresh :class:`BlockKey` over a copy of its hash, as a daemon decodes it from a
    message, and the caller's objects are dropped before the heap is read: what remains is the index."""
    gc.collect()
    tracemalloc.start()
    try:
        reg = Registry(TIERS)
        base, _ = tracemalloc.get_traced_memory()
        for k in keys:
            fresh = BlockKey(k.namespace, bytes(bytearray(k.hash)))
            for t in tiers:
                reg.add(t, fresh, 8 * MiB)
        del fresh
        gc.collect()
        cur, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reg.count(tiers[0]) == len(keys) == len(reg)
    return (cur - base) / len(keys)


def bench_registry(opts: ManagerOptions, rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    """Ingest/remove rates, index memory and lookup latency of the manager's registry, in-process."""
    ns = f"kvbm-bench-{secrets.token_hex(8)}"
    n = opts.registered
    reps = max(1, opts.onboard_repeats)
    keys = _keys(n, ns)
    if "memory" in opts.groups:
        one = _index_bytes_per_block(keys, ["G3"])
        two = _index_bytes_per_block(keys, ["G2", "G3"])
        _row(rows, "index memory per block", "tracemalloc, one tier", one, "bytes",
             f"{n:,} blocks in G3; heap the registry keeps once the caller's keys are dropped")
        _row(rows, "index memory per block", "tracemalloc, two tiers", two, "bytes",
             f"{n:,} blocks each in G2 and G3 (per block, not per entry)")
        echo(f"  index memory: {one:.0f} B/block in one tier, {two:.0f} B/block in two (tracemalloc)")
    gc.collect()
    reg = Registry(TIERS)
    add_s, rm_s = [], []
    gc.collect()
    rss0 = _rss()
    for r in range(reps):
        t0 = time.perf_counter()
        for k in keys:
            reg.add("G3", k, 8 * MiB)
        add_s.append(time.perf_counter() - t0)
        if r == 0:
            rss1 = _rss()  # the first fill: later ones reuse the dict the removes left behind
        if r == reps - 1:
            break
        t0 = time.perf_counter()
        for k in keys:
            reg.remove("G3", k)
        rm_s.append(time.perf_counter() - t0)
    if "ingest" in opts.groups:
        dt = median(add_s)
        _row(rows, "block events ingested", "registry.add in-process", n / dt, "events/s",
             f"{n:,} BlockStored events into one tier, one thread; median of {len(add_s)}")
        msg = f"  registry.add: {n / dt:,.0f} events/s"
        if rm_s:
            _row(rows, "block events removed", "registry.remove in-process", n / median(rm_s), "events/s",
                 f"{n:,} BlockRemoved events, one thread; median of {len(rm_s)}")
            msg += f"; registry.remove: {n / median(rm_s):,.0f} events/s"
        echo(msg)
    if "memory" in opts.groups:
        # The keys exist before rss0: the delta is the index alone (allocator slack included).
        _row(rows, "index memory per block", "RSS delta", (rss1 - rss0) / n, "bytes", f"{n:,} blocks in G3")
        echo(f"  index memory: {(rss1 - rss0) / n:.0f} B/block (RSS delta)")
    if "lookup" in opts.groups:
        from kvbm.manager.core import BlockManager

        # A manager over no real tiers would refuse nothing: lookup only reads the registry.
        mgr = BlockManager([])
        mgr.registry = reg
        prefixes = [keys[i : i + opts.prefix_blocks] for i in range(0, min(n, 50 * opts.prefix_blocks),
                                                                     opts.prefix_blocks)]
        prefixes = [p for p in prefixes if len(p) == opts.prefix_blocks] or [keys[: opts.prefix_blocks]]
        p50s, p99s = [], []
        for _ in range(reps):
            lat = []
            for i in range(opts.lookups):
                p = prefixes[i % len(prefixes)]
                t = time.perf_counter()
                got = mgr.lookup(p)
                lat.append(time.perf_counter() - t)
                assert len(got) == len(p)
            s = summary([x * 1e6 for x in lat])
            p50s.append(s["p50"])
            p99s.append(s["p99"])
        via = f"manager.lookup in-process ({n:,} registered)"
        rounds = f"median of {reps} rounds of {opts.lookups}"
        _row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, median(p50s), "us", rounds)
        _row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, median(p99s), "us",
             f"{rounds}; held in G3 (G1, G2 empty)")
        echo(f"  lookup in-process: p50 {median(p50s):.0f} us, p99 {median(p99s):.0f} us")
    del reg, keys
    gc.collect()


# -- daemon ---------------------------------------------------------------------------------------------
def daemon_available() -> bool:
    try:
        import kvbm.client
        import kvbm.daemon  # noqa: F401
    except Exception:
        return False
    return True


def _daemon(tmp: Path, slot: int, host_bytes: int) -> DaemonProc:
    """A G2-only daemon on an ipc socket in ``tmp``, logging warnings only (no log I/O while measured)."""
    cfg = {
        "block_bytes": slot, "device": {"enabled": False}, "host": {"capacity": host_bytes, "pin": False},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock",
                   "metrics_port": 0, "max_inflight": 4096, "max_queue": 4096, "log_format": "json"},
    }
    return DaemonProc(tmp, cfg, args=("--log-level", "warning"))


def bench_daemon(opts: ManagerOptions, rows: list[dict[str, Any]], work: Path, echo: Callable[[str], None]) -> None:
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import WorkerClient

    # A tiny layout: 16 tokens x 1 layer x 1 head x 16 x fp16 x K,V = 1 KiB blocks, so G2 holds every event.
    layout = KVLayout(model="kvbm-bench/tiny", num_layers=1, num_kv_heads=1, head_size=16, dtype="float16",
                      tokens_per_block=16, block_bytes=1024)
    slot = layout.block_nbytes
    n = opts.daemon_events
    total = max(n, opts.daemon_registered or opts.registered)
    reps = max(1, opts.onboard_repeats)
    # G2 holds every block (1 KiB each), so the daemon's registry ends up with ``total`` blocks.
    d = _daemon(work, slot, (total + opts.prefix_blocks + 64) * slot)
    d.start(ready=(work / "kvbm.sock").exists)
    try:
        with WorkerClient(d.endpoint, timeout_s=60.0) as c:
            c.register(layout, worker_id=f"bench-{os.getpid()}")
            keys = _keys(total, layout.namespace)
            buf = np.zeros(slot, dtype=np.uint8)
            bs = opts.daemon_batch
            c.ping()
            # warm-up batch, not counted
            c.store(keys[:bs], [buf] * bs)
            # (a) one store() call per batch, as a caller with small batches does: 2 round trips per batch.
            half = bs + (n - bs) // 2 // bs * bs
            cpu0 = d.cpu()
            with CpuMeter() as m:
                stored = bs
                for i in range(bs, half, bs):
                    chunk = keys[i : i + bs]
                    stored += c.store(chunk, [buf] * len(chunk)).stored
            dcpu, cnt = d.cpu() - cpu0, half - bs
            ev = cnt / m.wall
            _row(rows, "block events ingested", f"daemon socket (ipc, one store() per batch of {bs})", ev, "events/s",
                 f"PrepareStore+copy+CommitStore of {slot} B blocks; daemon CPU {dcpu / cnt * 1e6:.1f} us/event,"
                 f" client {m.cpu / cnt * 1e6:.1f} us/event", stored=stored)
            echo(f"  ingest via daemon, one store() per {bs}: {ev:,.0f} events/s")
            # (b) one store() of many blocks, pipelined by the client in requests of ``bs`` blocks, and (c) in
            # requests of the client's default batch (a caller that has more blocks at once, e.g. vLLM's saves).
            plans = [(bs, half, n if bs >= WorkerClient.store_batch else half + (n - half) // 2)]
            if bs < WorkerClient.store_batch:
                plans.append((WorkerClient.store_batch, plans[0][2], n))
            for step, lo, hi in plans:
                c.store_batch = step
                cpu0 = d.cpu()
                with CpuMeter() as m:
                    stored += c.store(keys[lo:hi], np.zeros((hi - lo, slot), dtype=np.uint8)).stored
                dcpu = d.cpu() - cpu0
                ev = (hi - lo) / m.wall
                _row(rows, "block events ingested", f"daemon socket (ipc, store() pipelined in requests of {step})", ev,
                     "events/s", f"{hi - lo:,} blocks in one store(): next PrepareStore sent before this batch's copy,"
                     f" <= {c.store_window} commits in flight; daemon CPU {dcpu / (hi - lo) * 1e6:.1f} us/event,"
                     f" client {m.cpu / (hi - lo) * 1e6:.1f} us/event", stored=stored)
                echo(f"  ingest via daemon, pipelined in requests of {step}: {ev:,.0f} events/s ({stored:,} stored)")
            c.store_batch = WorkerClient.store_batch
            if total > n:
                echo(f"  filling the daemon to {total:,} blocks ...")
                fill = 65536
                for i in range(n, total, fill):
                    chunk = keys[i : i + fill]
                    stored += c.store(chunk, np.zeros((len(chunk), slot), dtype=np.uint8)).stored
            st = c.stats()
            # round trip and lookup latency: ``reps`` rounds, the median of each percentile
            rtt = []
            for _ in range(200):
                t = time.perf_counter()
                c.ping()
                rtt.append(time.perf_counter() - t)
            pref = [k.hash for k in keys[: opts.prefix_blocks]]
            p50s, p99s = [], []
            for _ in range(reps):
                lat = []
                for _ in range(opts.daemon_lookups):
                    t = time.perf_counter()
                    rep = c.lookup(pref)
                    lat.append(time.perf_counter() - t)
                    assert rep.matched == len(pref), rep
                s = summary([x * 1e6 for x in lat])
                p50s.append(s["p50"])
                p99s.append(s["p99"])
            via = f"daemon socket ({stored:,} registered)"
            rounds = f"median of {reps} rounds of {opts.daemon_lookups}"
            _row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, median(p50s), "us",
                 f"{rounds}; ping round trip p50 {median(rtt) * 1e6:.0f} us")
            _row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, median(p99s), "us",
                 f"{rounds}; per round {', '.join(f'{x:.0f}' for x in p99s)}")
            _row(rows, "daemon RSS", via, _proc_rss(d.proc.pid) / MiB if d.proc else 0.0, "MiB",
                 f"daemon reports {_blocks_of(st):,} blocks; G2 pool in shared memory not counted")
            echo(f"  lookup via daemon: p50 {median(p50s):.0f} us, p99 {median(p99s):.0f} us"
                 f" (ping {median(rtt) * 1e6:.0f} us)")
    finally:
        d.stop()


# -- onboard overhead -------------------------------------------------------------------------------
async def bench_onboard(opts: ManagerOptions, rows: list[dict[str, Any]], work: Path,
                        echo: Callable[[str], None]) -> dict[str, Any]:
    from kvbm.stack import build_stack

    n, size = opts.onboard_blocks, opts.block_bytes
    ns = f"kvbm-bench-{secrets.token_hex(8)}"
    keys = _keys(n, ns)
    data = [rnd_bytes(size, i) for i in range(n)]
    nbytes = n * size
    out: dict[str, Any] = {}
    cap = (n + 1) * size
    with s3_server(work, endpoint=opts.s3_endpoint, access_key=opts.s3_access_key, secret_key=opts.s3_secret_key,
                   bucket=opts.s3_bucket) as srv:
        d: dict[str, Any] = {
            "block_bytes": size, "device": {"enabled": False}, "host": {"capacity": cap, "pin": True},
            "disk": {"dir": str(work / "g3"), "capacity": 3 * cap, "o_direct": True, "fsync": True},
            "s3": {"enabled": True, "endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": srv["prefix"],
                   "access_key": srv["access_key"], "secret_key": srv["secret_key"], "client": "aiobotocore",
                   "max_pending_writes": max(64, n)},
            "embedded_s3": {"enabled": False}, "transfer": {"backend": "auto"},
        }
        stack = await build_stack(msgspec.convert(d, Config), tiers=("G2", "G3", "G4"), index=False)
        mgr = stack.manager
        g3, g4 = mgr.by_name["G3"], mgr.by_name["G4"]
        cli = boto3_client(srv)
        pool = ThreadPoolExecutor(8)
        try:
            for k, a in zip(keys, data, strict=True):
                await mgr.put(k, memoryview(a), tier="G2", cascade=False)
            assert await mgr.offload(keys, durable=True) == n
            # Page-aligned and pre-faulted, like the G2 pool the onboard lands in (O_DIRECT reads go straight in).
            sink_map = mmap.mmap(-1, n * size)
            sink = np.frombuffer(sink_map, dtype=np.uint8).reshape(n, size)
            sink.fill(0)

            async def tier_reads(tier: Any) -> None:
                # The tier alone, at the manager's concurrency (all blocks gathered), into plain buffers.
                got = await asyncio.gather(*(tier.get_into(k, memoryview(sink[i])) for i, k in enumerate(keys)))
                assert all(g == size for g in got)

            def raw_g3() -> None:
                for i, k in enumerate(keys):
                    fd = os.open(g3.path_for(k), os.O_RDONLY)
                    try:
                        os.preadv(fd, [memoryview(sink[i])], 4096)
                    finally:
                        os.close(fd)

            def raw_g4() -> None:
                def one(i: int) -> None:
                    cli.get_object(Bucket=srv["bucket"], Key=g4.object_key(keys[i]))["Body"].read()

                list(pool.map(one, range(n)))

            async def cold() -> None:
                await asyncio.to_thread(lambda: [g3.drop_page_cache(k) for k in keys])

            for src, tier, raw, below in (("G3", g3, raw_g3, ["G2"]), ("G4", g4, raw_g4, ["G2", "G3"])):
                t_on, t_tier, t_raw = [], [], []
                for _ in range(opts.onboard_repeats):
                    await mgr.delete(keys, tiers=below)
                    await cold()
                    assert mgr.lookup(keys) == [src] * n
                    t = time.perf_counter()
                    got = await mgr.onboard(keys, to="G2")
                    t_on.append(time.perf_counter() - t)
                    assert got == n
                    await cold()
                    t = time.perf_counter()
                    await tier_reads(tier)
                    t_tier.append(time.perf_counter() - t)
                    await cold()
                    if src == "G3":  # the raw baseline reads kvbm's own files; make them cold for it too
                        await asyncio.to_thread(lambda: [g3.drop_page_cache(k) for k in keys])
                    t = time.perf_counter()
                    await asyncio.to_thread(raw)
                    t_raw.append(time.perf_counter() - t)
                on, ti, ra = median(t_on), median(t_tier), median(t_raw)
                rawname = "pread" if src == "G3" else "boto3 get x8"
                _row(rows, f"onboard {n} x {size / MiB:g} MiB from {src}", "manager.onboard to G2", on * 1e3, "ms",
                     f"{nbytes / on / MB:.0f} MB/s")
                _row(rows, f"onboard overhead vs {src} tier reads", "onboard - tier.get_into (same blocks)",
                     (on - ti) * 1e3, "ms", f"{(on - ti) / n * 1e3:.2f} ms/block; tier alone {ti * 1e3:.0f} ms")
                _row(rows, f"onboard overhead vs raw {src} transfer", f"onboard - {rawname}", (on - ra) * 1e3, "ms",
                     f"{(on - ra) / n * 1e3:.2f} ms/block; raw {ra * 1e3:.0f} ms ({nbytes / ra / MB:.0f} MB/s)")
                out[src] = {"onboard_s": t_on, "tier_s": t_tier, "raw_s": t_raw}
                echo(f"  onboard from {src}: {on * 1e3:.0f} ms; tier reads {ti * 1e3:.0f} ms; raw {ra * 1e3:.0f} ms")
            await mgr.delete(keys)
        finally:
            pool.shutdown()
            cli.close()
            await stack.close()
            with contextlib.suppress(Exception):
                delete_prefix(srv, srv["prefix"])
    return out


async def run_manager(opts: ManagerOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    has_daemon = daemon_available()
    use_daemon = opts.daemon != "off" and has_daemon and "daemon" in opts.groups
    report: dict[str, Any] = {"bench": "manager", "machine": machine(), "options": asdict(opts), "rows": rows,
                              "daemon": {"available": has_daemon, "used": use_daemon}}
    echo(f"kvbm bench manager: {opts.registered:,} blocks registered, {opts.prefix_blocks}-block prefix; daemon: "
         + ("socket" if use_daemon else "not used (kvbm.daemon missing)" if not has_daemon else "off"))
    if {"ingest", "lookup", "memory"} & set(opts.groups):
        bench_registry(opts, rows, echo)
    with temp_dir("kvbm-bench-mgr-", opts.workdir) as work:
        if use_daemon:
            bench_daemon(opts, rows, work, echo)
        if "onboard" in opts.groups:
            report["onboard"] = await bench_onboard(opts, rows, work, echo)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["load_avg_end"] = load_avg()
    return report
