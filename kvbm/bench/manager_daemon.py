"""``kvbm bench manager`` through the daemon's socket: block events stored per second and prefix lookups with the
daemon filled, its CPU and RSS."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.common import CpuMeter, DaemonProc, median, summary
from kvbm.bench.manager_options import ManagerOptions, MiB, add_row, block_keys
from kvbm.daemon.launch import ipc_endpoint, ipc_exists


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
        "daemon": {"endpoint": ipc_endpoint(tmp, "kvbm.sock"), "events_endpoint": ipc_endpoint(tmp, "events.sock"),
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
    d.start(marks=(), ready=ipc_exists(ipc_endpoint(work, "kvbm.sock")))
    try:
        with WorkerClient(d.endpoint, timeout_s=60.0) as c:
            c.register(layout, worker_id=f"bench-{os.getpid()}")
            keys = block_keys(total, layout.namespace)
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
            add_row(rows, "block events ingested", f"daemon socket (ipc, one store() per batch of {bs})", ev,
                    "events/s", f"PrepareStore+copy+CommitStore of {slot} B blocks;"
                    f" daemon CPU {dcpu / cnt * 1e6:.1f} us/event,"
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
                add_row(rows, "block events ingested",
                        f"daemon socket (ipc, store() pipelined in requests of {step})", ev, "events/s",
                        f"{hi - lo:,} blocks in one store(): next PrepareStore sent before this batch's copy,"
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
            add_row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, median(p50s), "us",
                    f"{rounds}; ping round trip p50 {median(rtt) * 1e6:.0f} us")
            add_row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, median(p99s), "us",
                    f"{rounds}; per round {', '.join(f'{x:.0f}' for x in p99s)}")
            add_row(rows, "daemon RSS", via, _proc_rss(d.proc.pid) / MiB if d.proc else 0.0, "MiB",
                    f"daemon reports {_blocks_of(st):,} blocks; G2 pool in shared memory not counted")
            echo(f"  lookup via daemon: p50 {median(p50s):.0f} us, p99 {median(p99s):.0f} us"
                 f" (ping {median(rtt) * 1e6:.0f} us)")
    finally:
        d.stop()
