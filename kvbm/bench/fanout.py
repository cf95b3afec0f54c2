"""The fan-out figure of ``kvbm bench fleet`` (group ``fanout``): N daemons that found each other through the
bucket (discovery, no peer lists); a block any of them stores durably, how long until every other one finds it.

Each round a different daemon writes. Every reader first looks the block up (a miss: with probes on, it is
now in the reader's negative cache), then the writer stores it durably, then the readers are polled in turn
until each finds it. Mode ``events``: discovery on, so each reader follows the writer's events; mode
``probe``: no events, the reader's bucket probe finds the block once its negative-cache entry expires
(``negative_ttl_s``). Afterwards every reader loads every block it found and checks each byte.

With ``kill_volume`` (on a :class:`~kvbm.s3server.cluster.SeaweedCluster`), the volume server holding most of
the blocks is killed halfway through the ``events`` rounds: stores go on where the cluster acks them, and every
acked block must still load byte-exact on every reader.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvbm.bench.common import DaemonProc, percentile, summary
from kvbm.daemon.launch import ipc_endpoint


def _cfg(root: Path, srv: dict[str, Any], endpoint: str, prefix: str, block_bytes: int, i: int, mode: str,
         negative_ttl_s: float) -> dict[str, Any]:
    events = mode == "events"
    return {
        "block_bytes": block_bytes, "device": {"enabled": False},
        "host": {"capacity": max(32 * block_bytes, 4 << 20), "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": endpoint, "bucket": srv["bucket"], "prefix": prefix, "access_key": srv["access_key"],
               "secret_key": srv["secret_key"]},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": ipc_endpoint(root, f"{mode}-{i}.sock"),
                   "events_endpoint": ipc_endpoint(root, f"{mode}-{i}-ev.sock") if events else "",
                   "metrics_port": 0, "node_id": f"{mode}-{i}", "prefetch": False, "access_log_interval_s": 0,
                   "probe_negative_ttl_s": negative_ttl_s, "discovery": events, "discovery_interval_s": 0.5,
                   "discovery_ttl_s": 10.0},
    }


def _stats(xs: list[float]) -> dict[str, float] | None:
    return {**summary(xs), "p95": percentile(xs, 95)} if xs else None


def _until_found(client: Any, key: Any, t_ack: float, timeout_s: float) -> float | None:
    """Seconds from ``t_ack`` until ``client``'s lookup finds ``key`` (polled every millisecond), or None."""
    deadline = t_ack + timeout_s
    while time.perf_counter() < deadline:
        if client.lookup([key]).matched:
            return time.perf_counter() - t_ack
        time.sleep(0.001)
    return None


def run_fanout(opts: Any, srv: dict[str, Any], root: Path, mode: str, say: Callable[[str], None],
               cluster: Any = None) -> dict[str, Any]:
    """One mode (``events`` or ``probe``) of the fan-out figure; see the module docstring."""
    import numpy as np

    from kvbm.blocks import BlockKey
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import WorkerClient

    n = max(2, opts.fanout_daemons)
    layout = KVLayout(model="bench-fanout", num_layers=1, num_kv_heads=1, head_size=opts.block_bytes // 2,
                      dtype="uint8", kv_factor=2, tokens_per_block=1, block_bytes=opts.block_bytes)
    prefix = f"{srv['prefix']}-fanout-{mode}"
    endpoints = srv.get("endpoints") or [srv["endpoint"]]
    daemons = [DaemonProc(root / f"{mode}{i}", _cfg(root, srv, endpoints[i % len(endpoints)], prefix,
                                                    opts.block_bytes, i, mode, opts.negative_ttl_s), f"{mode}{i}")
               for i in range(n)]
    out: dict[str, Any] = {"mode": mode, "daemons": n, "gateways": len(endpoints), "rounds": opts.fanout_rounds,
                           "negative_ttl_s": opts.negative_ttl_s}
    clients: list[WorkerClient] = []
    lat: list[float] = []
    never = 0
    stored: list[tuple[Any, np.ndarray, int]] = []  # (key, bytes, writer)
    refused = 0
    killed = ""
    pool = ThreadPoolExecutor(max_workers=n - 1)
    try:
        t0 = time.perf_counter()
        for d in daemons:
            d.start()
        for d in daemons:
            c = WorkerClient(d.endpoint, timeout_s=60.0)
            c.register(layout, worker_id=f"bench-{d.name}")
            clients.append(c)
        out["start_s"] = round(time.perf_counter() - t0, 2)
        if mode == "events":  # every daemon follows the n-1 others, found in the bucket
            t0 = time.perf_counter()
            deadline = t0 + 120.0
            while time.perf_counter() < deadline:
                if all(sum(p["connected"] for p in c.stats()["daemon"]["fleet"]["peers"]) == n - 1 for c in clients):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("the daemons did not all follow each other within 120 s")
            out["mesh_s"] = round(time.perf_counter() - t0, 2)
            say(f"fanout/{mode}: {n} daemons follow each other after {out['mesh_s']:.1f}s (discovery)")
        ns = layout.namespace
        for r in range(opts.fanout_rounds):
            if cluster is not None and opts.kill_volume and mode == "events" and r == opts.fanout_rounds // 2:
                holders = cluster.chunk_holders(prefix + "/")
                killed = max(holders, key=lambda k: holders[k])
                cluster.kill(killed)
                out["killed"] = {"server": killed, "chunk_copies_on_it": holders[killed], "at_round": r}
                say(f"fanout/{mode}: killed {killed} ({holders[killed]} chunk copies of the blocks so far)")
            w = r % n
            k = BlockKey(ns, os.urandom(16))
            buf = np.frombuffer(os.urandom(opts.block_bytes), np.uint8)
            readers = [i for i in range(n) if i != w]
            for i in readers:
                clients[i].lookup([k])  # a miss (negative-cached where probes are on)
            try:
                ack = clients[w].store([k], [buf], durable=True)
            except Exception as e:  # a store the cluster could not take: not acked, not timed
                say(f"fanout/{mode}: round {r}: store failed: {type(e).__name__}: {e}")
                refused += 1
                continue
            t_ack = time.perf_counter()
            if not ack.durable:
                refused += 1
                continue
            stored.append((k, buf, w))
            # One thread per reader, each polling its own client: a slow reader does not delay the others' figure.
            got = list(pool.map(lambda i, k=k, t=t_ack: _until_found(clients[i], k, t, opts.hit_timeout_s), readers))
            lat.extend(x for x in got if x is not None)
            never += sum(x is None for x in got)
        verified = wrong = missing = 0
        for i, c in enumerate(clients):
            for k, buf, w in stored:
                if w == i:
                    continue
                got = np.zeros(opts.block_bytes, np.uint8)
                if c.load([k], [got]) != 1:
                    missing += 1
                elif np.array_equal(got, buf):
                    verified += 1
                else:
                    wrong += 1
        found = _stats(lat)
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
        out.update(acked=len(stored), refused=refused, samples=len(lat), never_found=never, found_s=found,
                   verified_loads=verified, wrong_bytes=wrong, missing_loads=missing)
        say(f"fanout/{mode}: {len(lat)} finds of {len(stored)} blocks x {n - 1} readers"
            + (f": p50 {found['p50'] * 1e3:.1f} ms, p95 {found['p95'] * 1e3:.1f} ms, max {found['max'] * 1e3:.1f} ms"
               if found else "") + f"; {never} never found; loads {verified} exact, {wrong} wrong, {missing} missing")
    finally:
        pool.shutdown()
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
        if killed:
            cluster.restart(killed)
    return out
