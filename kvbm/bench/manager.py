"""``kvbm bench manager``: the manager's bookkeeping costs.

* **ingest**: block events (a block stored in a tier) per second: through the daemon's socket
  (PrepareStore + copy into G2 shared memory + CommitStore, batched) when :mod:`kvbm.daemon` exists,
  and straight into ``manager.registry`` in-process.
* **lookup**: ``manager.lookup`` (``registry.match_prefix``) latency for a fully held 1,000-block prefix
  with 1M blocks registered (in-process), and the same request through the daemon's socket.
* **index memory** per registered block (tracemalloc, and the RSS delta of the 1M registration).
* **onboard overhead**: a full onboard of N blocks from G3 and from G4 minus (a) the tier's own reads of
  the same blocks at the same concurrency and (b) a raw transfer of the same bytes (pread / boto3 GET).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import mmap
import os
import secrets
import signal
import subprocess
import sys
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
    CpuMeter,
    boto3_client,
    delete_prefix,
    machine,
    median,
    rnd_bytes,
    s3_server,
    summary,
    temp_dir,
)
from kvbm.blocks import BlockKey
from kvbm.config import Config
from kvbm.registry import Registry

MiB = 1024 * 1024


@dataclass
class ManagerOptions:
    registered: int = 1_000_000
    prefix_blocks: int = 1000
    lookups: int = 1000
    daemon: str = "auto"  # auto: use kvbm.daemon when it exists; off
    daemon_events: int = 50_000
    daemon_batch: int = 64
    daemon_lookups: int = 500
    onboard_blocks: int = 32
    block_bytes: int = 8 * MiB
    onboard_repeats: int = 3
    groups: tuple[str, ...] = ("ingest", "lookup", "memory", "daemon", "onboard")
    workdir: str | None = None
    s3_endpoint: str | None = None
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_bucket: str = "kvbm-bench"


TIERS = ["G1", "G2", "G3", "G4"]


def _keys(n: int, ns: str) -> list[BlockKey]:
    # 16-byte hashes like kvbm's BLAKE2b-128 chain hashes; os.urandom in one call is fast.
    raw = os.urandom(16 * n)
    return [BlockKey(ns, raw[i * 16 : (i + 1) * 16]) for i in range(n)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _row(rows: list[dict[str, Any]], metric: str, via: str, value: float, unit: str, note: str = "",
         **extra: Any) -> None:
    rows.append({"metric": metric, "via": via, "value": value, "unit": unit, "note": note, **extra})


def bench_registry(opts: ManagerOptions, rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    """Ingest rate, index memory and lookup latency of the manager's registry, in-process."""
    ns = f"kvbm-bench-{secrets.token_hex(8)}"
    n = opts.registered
    # Memory: tracemalloc over a 100k sample (keys included: the index holds them), RSS over the whole run.
    sample = min(n, 100_000)
    gc.collect()
    tracemalloc.start()
    reg_s = Registry(TIERS)
    base, _ = tracemalloc.get_traced_memory()
    ks = _keys(sample, ns)
    for k in ks:
        reg_s.add("G3", k, 8 * MiB)
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_block_tm = (cur - base) / sample
    del reg_s, ks
    gc.collect()

    rss0 = _rss()
    keys = _keys(n, ns)
    reg = Registry(TIERS)
    t0 = time.perf_counter()
    for k in keys:
        reg.add("G3", k, 8 * MiB)
    dt = time.perf_counter() - t0
    rss1 = _rss()
    if "ingest" in opts.groups:
        _row(rows, "block events ingested", "registry.add in-process", n / dt, "events/s",
             f"{n:,} BlockStored events into one tier, one thread")
        echo(f"  ingest in-process: {n / dt:,.0f} events/s")
    if "memory" in opts.groups:
        _row(rows, "index memory per block", "tracemalloc (registry + key)", per_block_tm, "bytes",
             f"{sample:,}-block sample, BlockKey with 16-byte hash included")
        _row(rows, "index memory per block", "RSS delta", (rss1 - rss0) / n, "bytes", f"{n:,} blocks")
        echo(f"  index memory: {per_block_tm:.0f} B/block (tracemalloc), {(rss1 - rss0) / n:.0f} B/block (RSS)")
    if "lookup" in opts.groups:
        from kvbm.manager import BlockManager

        # A manager over no real tiers would refuse nothing: lookup only reads the registry.
        mgr = BlockManager([])
        mgr.registry = reg
        prefixes = [keys[i : i + opts.prefix_blocks] for i in range(0, min(n, 50 * opts.prefix_blocks),
                                                                     opts.prefix_blocks)]
        prefixes = [p for p in prefixes if len(p) == opts.prefix_blocks] or [keys[: opts.prefix_blocks]]
        lat = []
        for i in range(opts.lookups):
            p = prefixes[i % len(prefixes)]
            t = time.perf_counter()
            got = mgr.lookup(p)
            lat.append(time.perf_counter() - t)
            assert len(got) == len(p)
        s = summary([x * 1e6 for x in lat])
        via = f"manager.lookup in-process ({n:,} registered)"
        _row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, s["p50"], "us")
        _row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, s["p99"], "us",
             "held in G3: each key misses G1, G2 first")
        echo(f"  lookup in-process: p50 {s['p50']:.0f} us, p99 {s['p99']:.0f} us")
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


class _DaemonProc:
    """``python -m kvbm.cli.serve`` on an ipc socket in ``tmp`` with a G2-only stack."""

    def __init__(self, tmp: Path, slot: int, host_bytes: int) -> None:
        self.tmp = tmp
        self.endpoint = f"ipc://{tmp}/kvbm.sock"
        cfg = {
            "block_bytes": slot, "device": {"enabled": False}, "host": {"capacity": host_bytes, "pin": False},
            "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
            "transfer": {"backend": "plain"},
            "daemon": {"endpoint": self.endpoint, "events_endpoint": f"ipc://{tmp}/events.sock",
                       "metrics_port": 0, "max_inflight": 4096, "max_queue": 4096, "log_format": "json"},
        }
        self.cfg_path = tmp / "kvbm.yaml"
        self.cfg_path.write_text(json.dumps(cfg))
        self.log = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(self.cfg_path),
                                          "--log-level", "warning"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        sock = self.tmp / "kvbm.sock"
        while time.monotonic() < deadline:
            if sock.exists():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start: {self.log.read_text()[-2000:]}")

    def cpu(self) -> float:
        from kvbm.bench.common import proc_cpu_seconds

        return proc_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in Path("/dev/shm").glob(f"kvbm-g2-{self.proc.pid}-*"):
            with contextlib.suppress(OSError):
                f.unlink()


def bench_daemon(opts: ManagerOptions, rows: list[dict[str, Any]], work: Path, echo: Callable[[str], None]) -> None:
    from kvbm.client import WorkerClient
    from kvbm.layout import KVLayout

    # A tiny layout: 16 tokens x 1 layer x 1 head x 16 x fp16 x K,V = 1 KiB blocks, so G2 holds every event.
    layout = KVLayout(model="kvbm-bench/tiny", num_layers=1, num_kv_heads=1, head_size=16, dtype="float16",
                      tokens_per_block=16, block_bytes=1024)
    slot = layout.block_nbytes
    n = opts.daemon_events
    d = _DaemonProc(work, slot, (n + opts.prefix_blocks + 64) * slot)
    d.start()
    try:
        with WorkerClient(d.endpoint, timeout_s=30.0) as c:
            c.register(layout, worker_id=f"bench-{os.getpid()}")
            keys = _keys(n, layout.namespace)
            buf = np.zeros(slot, dtype=np.uint8)
            bs = opts.daemon_batch
            c.ping()
            # warm-up batch, not counted
            c.store(keys[:bs], [buf] * bs)
            cpu0 = d.cpu()
            with CpuMeter() as m:
                stored = bs
                for i in range(bs, n, bs):
                    chunk = keys[i : i + bs]
                    stored += c.store(chunk, [buf] * len(chunk)).stored
            dcpu = d.cpu() - cpu0
            ev = (n - bs) / m.wall
            _row(rows, "block events ingested", f"daemon socket (ipc, store batches of {bs})", ev, "events/s",
                 f"PrepareStore+copy+CommitStore of {slot} B blocks; daemon CPU {dcpu / (n - bs) * 1e6:.1f} us/event,"
                 f" client {m.cpu / (n - bs) * 1e6:.1f} us/event", stored=stored)
            echo(f"  ingest via daemon: {ev:,.0f} events/s ({stored:,} stored)")
            # round trip and lookup latency
            rtt = []
            for _ in range(200):
                t = time.perf_counter()
                c.ping()
                rtt.append(time.perf_counter() - t)
            lat = []
            pref = keys[: opts.prefix_blocks]
            for _ in range(opts.daemon_lookups):
                t = time.perf_counter()
                rep = c.lookup(pref)
                lat.append(time.perf_counter() - t)
                assert rep.matched == len(pref), rep
            s = summary([x * 1e6 for x in lat])
            via = f"daemon socket ({stored:,} registered)"
            _row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, s["p50"], "us",
                 f"ping round trip p50 {median(rtt) * 1e6:.0f} us")
            _row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, s["p99"], "us")
            echo(f"  lookup via daemon: p50 {s['p50']:.0f} us, p99 {s['p99']:.0f} us (ping {median(rtt) * 1e6:.0f} us)")
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
    return report
