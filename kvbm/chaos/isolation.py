"""``kvbm bench isolation``: one tenant's load keeps another's p99 within 2x of its solo run (issue 37).

One ``kvbm serve`` (G2 shared memory, G3 on disk, no S3) serves two tenants. Tenant A's engine stores a few
blocks once, then times ``lookup`` + ``load`` of them, one after another (what an engine does for a prefix hit).
Each repeat times A alone, then again while tenant B floods the daemon at its caps: B's sessions (another process,
asyncio clients) store fresh blocks and look them up as fast as the daemon answers, with as many requests in flight
as B's ``max_inflight`` lets through (a request past it is answered ``busy`` at once, and counted). The report:
A's p50/p99 per repeat, their medians, and ``ratio_p99`` = median loaded p99 / median solo p99; also where A's
loads were served from (a flood that evicted A's blocks from G2 would make A read G3).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.common import load_avg, machine, percentile
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.daemon.launch import DaemonLauncher, ipc_endpoint

LAYOUTS = {"a": KVLayout(model="iso/a", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                         tokens_per_block=64),
           "b": KVLayout(model="iso/b", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                         tokens_per_block=64)}


@dataclass
class IsolationOptions:
    repeats: int = 5
    iters: int = 400  # A's lookup+load pairs timed per phase
    blocks: int = 8  # A's blocks per lookup+load (a prefix)
    b_sessions: int = 4  # B's registered sessions
    b_inflight: int = 16  # B's tenant max_inflight: its flood keeps this many requests in flight
    b_keys: int = 2048  # distinct blocks B cycles through (more than G2 holds: its stores keep evicting)
    warm_s: float = 1.0  # the flood runs this long before A is timed
    b_stores: bool = True  # B's flood stores (and looks up) blocks; False: lookups only


def daemon_config(tmp: Path, o: IsolationOptions) -> dict[str, Any]:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "16MiB", "pin": False},
        "disk": {"dir": str(tmp / "disk"), "capacity": "256MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": ipc_endpoint(tmp, "d.sock"), "events_endpoint": "", "metrics_port": 0,
                   "admin_token_file": str(tmp / "admin.token"),
                   "tenants": [{"name": "a", "token_file": str(tmp / "a.token"),
                                "namespaces": [LAYOUTS["a"].namespace]},
                               {"name": "b", "token_file": str(tmp / "b.token"), "models": ["iso/b"],
                                "max_inflight": o.b_inflight}]},
    }


def _key(ns: str, tag: str, i: int) -> BlockKey:
    import hashlib

    return BlockKey(ns, hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest())


# -- tenant B's flood (a process of its own) ------------------------------------------------------------------------
def _flood_main(endpoint: str, token: str, o: IsolationOptions, stop: Any, counts: Any) -> None:
    asyncio.run(_flood(endpoint, token, o, stop, counts))


async def _flood(endpoint: str, token: str, o: IsolationOptions, stop: Any, counts: Any) -> None:
    from kvbm.client import DaemonError, DaemonUnavailable
    from kvbm.client.aio import AsyncWorkerClient

    lay = LAYOUTS["b"]
    nb = lay.block_nbytes
    clients = []
    for s in range(o.b_sessions):
        c = AsyncWorkerClient(endpoint, timeout_s=10.0, tenant_token=token)
        await c.register(lay, worker_id=f"b{s}", engine_id=f"b-e{s}")
        clients.append(c)
    buf = np.full(nb, 7, np.uint8)
    per = max(1, o.b_inflight // o.b_sessions) + 1  # a little past its cap: some are answered busy

    async def loop(c: Any, lane: int) -> None:
        i = lane * 4
        while not stop.is_set():
            ks = [_key(lay.namespace, "b", (i + j) % o.b_keys) for j in range(4)]
            i += 4 * per * o.b_sessions
            try:
                if o.b_stores:
                    await c.store(ks, [buf] * 4)
                    counts[0] += 1
                await c.lookup(ks)
                counts[0] += 1
            except DaemonError as e:
                counts[1 if e.code == "busy" else 2] += 1
            except DaemonUnavailable:
                counts[2] += 1

    await asyncio.gather(*(loop(c, s * per + k) for s, c in enumerate(clients) for k in range(per)))
    for c in clients:
        await c.close()


# -- tenant A, timed --------------------------------------------------------------------------------------------------
def _time_a(client: Any, keys: list[BlockKey], outs: list[np.ndarray], iters: int) -> tuple[list[float], dict]:
    lat: list[float] = []
    tiers: dict[str, int] = {}
    for _ in range(iters):
        t0 = time.perf_counter()
        r = client.lookup(keys)
        n = client.load(keys[: r.matched], outs[: r.matched])
        lat.append(time.perf_counter() - t0)
        for t in r.tiers[:n]:
            tiers[t] = tiers.get(t, 0) + 1
    return lat, tiers


def _summary(lat: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(lat, 50) * 1e3, 3), "p99_ms": round(percentile(lat, 99) * 1e3, 3)}


class _Flood:
    """Tenant B's flood against one daemon, in a process of its own, while A is timed."""

    def __init__(self, endpoint: str, token: str, o: IsolationOptions) -> None:
        ctx = mp.get_context("spawn")
        self.stop, self.counts = ctx.Event(), ctx.Array("q", 3)
        self.proc = ctx.Process(target=_flood_main, args=(endpoint, token, o, self.stop, self.counts), daemon=True)
        self.o = o

    def __enter__(self) -> _Flood:
        self.proc.start()
        deadline = time.monotonic() + 60
        while self.counts[0] < 50 and time.monotonic() < deadline and self.proc.is_alive():
            time.sleep(0.05)  # the flood is running (its sessions registered, requests answered)
        time.sleep(self.o.warm_s)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _phase(a: Any, keys: list[BlockKey], outs: list[np.ndarray], o: IsolationOptions,
           flood: tuple[str, str] | None) -> dict[str, Any]:
    """A timed, alone (``flood`` None) or while B floods the daemon at endpoint ``flood[0]``."""
    if flood is None:
        lat, tiers = _time_a(a, keys, outs, o.iters)
        return {**_summary(lat), "tiers": tiers}
    with _Flood(flood[0], flood[1], o) as f:
        before, t0 = list(f.counts), time.perf_counter()
        lat, tiers = _time_a(a, keys, outs, o.iters)
        secs, after = time.perf_counter() - t0, list(f.counts)
    return {**_summary(lat), "tiers": tiers, "b_requests_per_s": round((after[0] - before[0]) / secs, 1),
            "b_busy": after[1] - before[1], "b_errors": after[2] - before[2]}


def _start(root: Path, o: IsolationOptions) -> tuple[DaemonLauncher, str]:
    d = DaemonLauncher(root, daemon_config(root, o))
    d.start()
    return d, str(d.info.get("endpoint") or ipc_endpoint(root, "d.sock"))


def run_isolation(o: IsolationOptions, work: Path, echo: Any = print) -> dict[str, Any]:
    """Each repeat: A alone; A while B floods another daemon (the control: the same CPU taken from A and its
    daemon, nothing shared in the daemon); A while B floods A's daemon. ``ratio_p99``: shared over solo;
    ``ratio_control_p99``: control over solo; ``daemon_share_p99``: shared over control (what sharing the
    daemon adds beyond the machine's CPU)."""
    from kvbm.client import WorkerClient

    report: dict[str, Any] = {"bench": "isolation", "machine": machine(), "options": asdict(o),
                              "load_avg_start": load_avg(), "cpus": os.cpu_count(), "repeats": []}
    t0 = time.perf_counter()
    d, endpoint = _start(work / "shared", o)
    other, other_ep = _start(work / "other", o)
    try:
        lay = LAYOUTS["a"]
        a = WorkerClient(endpoint, timeout_s=10.0, tenant_token=(work / "shared" / "a.token").read_text().strip())
        a.register(lay, worker_id="a0", engine_id="a-e0")
        keys = [_key(lay.namespace, "a", i) for i in range(o.blocks)]
        a.store(keys, [np.full(lay.block_nbytes, i, np.uint8) for i in range(o.blocks)])
        outs = [np.zeros(lay.block_nbytes, np.uint8) for _ in keys]
        _time_a(a, keys, outs, 50)  # warm-up: the client's mapping, the daemon's paths
        tokens = {w: (work / w / "b.token").read_text().strip() for w in ("shared", "other")}
        for r in range(o.repeats):
            rep = {"solo": _phase(a, keys, outs, o, None),
                   "control": _phase(a, keys, outs, o, (other_ep, tokens["other"])),
                   "shared": _phase(a, keys, outs, o, (endpoint, tokens["shared"]))}
            report["repeats"].append(rep)
            echo(f"repeat {r}: A p99 solo {rep['solo']['p99_ms']} ms, B flooding another daemon "
                 f"{rep['control']['p99_ms']} ms, B flooding A's daemon {rep['shared']['p99_ms']} ms "
                 f"(B {rep['shared']['b_requests_per_s']} req/s, busy {rep['shared']['b_busy']})")
        with WorkerClient(endpoint, timeout_s=10.0,
                          admin_token=(work / "shared" / "admin.token").read_text().strip()) as adm:
            report["daemon_stats"] = {k: v for k, v in adm.stats()["daemon"].items()
                                      if k in ("requests", "shed", "client_limited", "errors")}
        a.close()
    finally:
        d.stop()
        other.stop()
    reps = report["repeats"]

    def med(phase: str, q: str) -> float:
        return round(statistics.median(x[phase][q] for x in reps), 3) if reps else 0.0

    def ratio(x: str, y: str, q: str) -> float:
        return round(report["median"][x][q] / max(report["median"][y][q], 1e-6), 2)

    report["median"] = {ph: {q: med(ph, q) for q in ("p50_ms", "p99_ms")} for ph in ("solo", "control", "shared")}
    report |= {"ratio_p99": ratio("shared", "solo", "p99_ms"), "ratio_p50": ratio("shared", "solo", "p50_ms"),
               "ratio_control_p99": ratio("control", "solo", "p99_ms"),
               "daemon_share_p99": ratio("shared", "control", "p99_ms"),
               "daemon_share_p50": ratio("shared", "control", "p50_ms")}
    report["within_2x"] = report["ratio_p99"] <= 2.0
    report["load_avg_end"] = load_avg()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report
