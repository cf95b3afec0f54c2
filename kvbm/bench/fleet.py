"""``kvbm bench fleet``: several daemons sharing one bucket, and listing a bucket at scale.

Figures:

* **ack -> hit**: daemon A acknowledges a durable store (the block is in the bucket); how long until a
  lookup on daemon B finds it (p50/p99 over ``blocks`` samples). Whatever kvbm does to make B see A's
  blocks (bucket probes on misses, peer events, re-listing) is measured as it is; a block B never finds
  within ``hit_timeout_s`` is counted as ``never_found``, not timed.
* **lookup cost**: round-trip time of a Lookup on B for blocks nobody holds (a miss, with whatever probe a
  miss costs) next to one for blocks B holds in G2.
* **fan-out** (group ``fanout``, :mod:`kvbm.bench.fanout`): ``fanout_daemons`` daemons that found each other
  through the bucket; how long until a block any of them stores is found by every other, with events
  (discovery) and with bucket probes alone (bounded by the negative TTL); with ``cluster`` on a distributed
  SeaweedFS (two gateways, nodes alternating), with ``kill_volume`` a volume server killed halfway.
* **listing**: time to list ``n`` block objects serially (``S3Tier.list_objects``, one page after another)
  and by shard directory (``S3Tier.list_objects_parallel``), for each ``n`` of ``listing_sizes``. Objects
  are tiny (a LIST costs the same whatever the object size); they are created with many concurrent PUTs,
  or reused from ``listing_prefix`` (kept afterwards, so a second run skips the creation).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbm.bench.common import BenchTarget, CpuMeter, DaemonProc, delete_prefix, s3_server, summary
from kvbm.bench.route import route_rows, run_route
from kvbm.bench.runner import BenchRun
from kvbm.daemon.launch import ipc_endpoint

LIST_NS = "bench-list-0123456789abcdef"


@dataclass
class FleetOptions(BenchTarget):
    daemons: int = 2
    blocks: int = 20
    hit_timeout_s: float = 10.0
    lookups: int = 200
    block_bytes: int = 64 * 1024
    listing_sizes: tuple[int, ...] = (100_000, 1_000_000)
    listing_prefix: str = ""
    put_concurrency: int = 128
    list_concurrency: int = 16
    groups: tuple[str, ...] = ("fleet", "listing")
    fanout_daemons: int = 8
    fanout_rounds: int = 16
    fanout_modes: tuple[str, ...] = ("events", "probe")
    negative_ttl_s: float = 1.0
    cluster: bool = False  # a SeaweedCluster (3 volume servers, replication 001, 2 gateways) instead of one server
    kill_volume: bool = False  # with cluster: kill the volume server holding most blocks halfway (events mode)
    # group "route" (kvbm.bench.route): routing on router events vs random, two nodes, the same seeded requests
    route_prefixes: int = 16
    route_prefix_blocks: int = 8
    route_own_blocks: int = 2
    route_requests: int = 200
    route_g2_blocks: int = 32
    route_g3_blocks: int = 64
    route_seed: int = 0


def _daemon_cfg(root: Path, srv: dict[str, Any], prefix: str, block_bytes: int, i: int) -> dict[str, Any]:
    return {
        "block_bytes": block_bytes, "device": {"enabled": False},
        "host": {"capacity": max(16 * block_bytes, 4 << 20), "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": prefix,
               "access_key": srv["access_key"], "secret_key": srv["secret_key"]},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": ipc_endpoint(root, f"d{i}.sock"), "events_endpoint": "", "metrics_port": 0,
                   "node_id": f"bench-{i}"},
    }


def _fleet(opts: FleetOptions, srv: dict[str, Any], root: Path, say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from kvbm.blocks import BlockKey
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import WorkerClient

    layout = KVLayout(model="bench-fleet", num_layers=1, num_kv_heads=1, head_size=opts.block_bytes // 2,
                      dtype="uint8", kv_factor=2, tokens_per_block=1, block_bytes=opts.block_bytes)
    prefix = f"{srv['prefix']}-fleet"
    daemons = [DaemonProc(root / f"d{i}", _daemon_cfg(root, srv, prefix, opts.block_bytes, i), f"d{i}")
               for i in range(max(2, opts.daemons))]
    out: dict[str, Any] = {"daemons": len(daemons), "blocks": opts.blocks, "hit_timeout_s": opts.hit_timeout_s}
    clients: list[WorkerClient] = []
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            c = WorkerClient(d.endpoint, timeout_s=30.0)
            c.register(layout)
            clients.append(c)
        a, b = clients[0], clients[1]
        buf = np.frombuffer(os.urandom(opts.block_bytes), np.uint8)
        ns = layout.namespace
        lat: list[float] = []
        never = 0
        for _ in range(opts.blocks):
            k = BlockKey(ns, os.urandom(16))
            a.store([k], [buf], durable=True)
            t0 = time.perf_counter()
            deadline = t0 + opts.hit_timeout_s
            found = False
            while time.perf_counter() < deadline:
                if b.lookup([k]).matched:
                    found = True
                    break
                time.sleep(0.001)
            if found:
                lat.append(time.perf_counter() - t0)
            else:
                never += 1
        out["ack_to_hit_s"] = summary(lat) if lat else None
        out["found"] = len(lat)
        out["never_found"] = never
        say(f"ack->hit: {len(lat)} of {opts.blocks} found by B"
            + (f", p50 {summary(lat)['p50'] * 1e3:.1f} ms p99 {summary(lat)['p99'] * 1e3:.1f} ms" if lat else "")
            + (f"; {never} never found within {opts.hit_timeout_s:g}s" if never else ""))
        held = [BlockKey(ns, os.urandom(16)) for _ in range(4)]
        b.store(held, [buf] * len(held))
        miss: list[float] = []
        hit: list[float] = []
        for i in range(opts.lookups):
            k = BlockKey(ns, os.urandom(16))
            t0 = time.perf_counter()
            b.lookup([k])
            miss.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b.lookup([held[i % len(held)]])
            hit.append(time.perf_counter() - t0)
        out["lookup_miss_s"] = summary(miss)
        out["lookup_hit_g2_s"] = summary(hit)
        out["probe_cost_per_lookup_s"] = summary(miss)["p50"] - summary(hit)["p50"]
        say(f"lookup on B: miss p50 {summary(miss)['p50'] * 1e6:.0f} us, G2 hit p50 {summary(hit)['p50'] * 1e6:.0f} us")
    finally:
        for c in clients:
            c.close()
        for d in daemons:
            d.stop()
        delete_prefix(srv, prefix + "/")  # A's blocks and the access logs
    return out


async def _put_tiny(tier: Any, sem: asyncio.Semaphore, key: str) -> None:
    async with sem:
        await tier.session.client.put_object(Bucket=tier.bucket, Key=key, Body=b"x")


def _list_key(i: int) -> str:
    h = hashlib.blake2b(i.to_bytes(8, "big"), digest_size=16).hexdigest()
    return f"{LIST_NS}/{h[:2]}/{h}"


async def _listing(opts: FleetOptions, srv: dict[str, Any], say: Callable[[str], None]) -> list[dict[str, Any]]:
    from kvbm.config import S3Config
    from kvbm.tiers.s3 import make_s3_tier

    rows = []
    for n in opts.listing_sizes:
        prefix = f"{opts.listing_prefix or srv['prefix'] + '-list'}/{n}"
        cfg = S3Config(bucket=srv["bucket"], prefix=prefix, max_concurrency=max(8, opts.put_concurrency // 2),
                       list_concurrency=opts.list_concurrency, create_bucket=True)
        tier = make_s3_tier(cfg, srv["endpoint"], (srv["access_key"], srv["secret_key"]))
        await tier.start()
        try:
            have = {k async for _b, k, _s, _m in tier.list_objects_parallel(LIST_NS)}
            todo = [i for i in range(n) if f"{prefix}/{_list_key(i)}" not in have]
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(opts.put_concurrency)

            for j in range(0, len(todo), 10_000):
                await asyncio.gather(*(_put_tiny(tier, sem, f"{prefix}/{_list_key(i)}") for i in todo[j : j + 10_000]))
            created_s = time.perf_counter() - t0
            if todo:
                say(f"listing {n}: created {len(todo)} objects in {created_s:.1f}s")
            row: dict[str, Any] = {"objects": n, "created": len(todo), "create_s": round(created_s, 2)}
            for mode in ("serial", "parallel"):
                with CpuMeter() as cpu:
                    t0 = time.perf_counter()
                    it = tier.list_objects(LIST_NS) if mode == "serial" else tier.list_objects_parallel(LIST_NS)
                    count = sum([1 async for bk, _k, _s, _m in it if bk is not None])
                    dt = time.perf_counter() - t0
                row[mode] = {"seconds": round(dt, 3), "objects_per_s": round(count / dt, 1) if dt else None,
                             "listed": count, "client_cpu_s": round(cpu.cpu, 3)}
                say(f"listing {n}: {mode} {dt:.2f}s ({count} blocks, {count / dt:,.0f}/s)")
            if row["parallel"]["listed"] != n or row["serial"]["listed"] != n:
                row["error"] = f"listed {row['serial']['listed']}/{row['parallel']['listed']} of {n} objects"
            rows.append(row)
            if not opts.listing_prefix:  # a dedicated, reusable prefix is kept; a fresh one is removed
                keys = [f"{prefix}/{_list_key(i)}" for i in range(n)]
                await tier.delete_many(keys)
        finally:
            await tier.close()
    return rows


@contextlib.contextmanager
def _store(opts: FleetOptions, root: Path) -> Iterator[tuple[dict[str, Any], Any]]:
    """The S3 store under the fleet: ``s3_server`` (given or one fresh SeaweedFS), or a fresh cluster."""
    if not opts.cluster:
        with s3_server(root, endpoint=opts.s3_endpoint, access_key=opts.s3_access_key, secret_key=opts.s3_secret_key,
                       bucket=opts.s3_bucket) as srv:
            yield srv, None
        return
    from kvbm.s3server.cluster import SeaweedCluster

    with SeaweedCluster(root / "cluster", replication="001", bucket=opts.s3_bucket, access_key="kvbm-bench",
                        secret_key=uuid.uuid4().hex) as c:
        yield {"endpoint": c.endpoint, "endpoints": c.endpoints, "access_key": c.access_key,
               "secret_key": c.secret_key, "bucket": c.bucket, "pid": None,
               "prefix": f"kvbm-bench-{uuid.uuid4().hex[:10]}", "embedded": True}, c


async def run_fleet(opts: FleetOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    # The store under the fleet may be a cluster: _store starts it, not the frame.
    bench = BenchRun("fleet", opts, say, s3=False, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    report = bench.report
    with bench, _store(opts, bench.work) as (srv, cluster):
        root = bench.work
        if cluster is not None:
            report["s3"] = (f"SeaweedFS cluster (fresh): 1 master, {cluster.volumes} volume servers, replication "
                            f"{cluster.replication}, {cluster.gateways} S3 gateways")
        elif not opts.s3_endpoint:
            report["s3"] = "embedded SeaweedFS (fresh)"
        if "fanout" in opts.groups:
            from kvbm.bench.fanout import run_fanout

            report["fanout"] = {}
            for mode in opts.fanout_modes:
                try:
                    report["fanout"][mode] = await asyncio.to_thread(run_fanout, opts, srv, root, mode, say, cluster)
                finally:
                    delete_prefix(srv, f"{srv['prefix']}-fanout-{mode}/")
            ev, pr = report["fanout"].get("events"), report["fanout"].get("probe")
            if ev and pr and ev.get("found_s") and pr.get("found_s"):
                report["fanout"]["probe_over_events_p50"] = round(pr["found_s"]["p50"] / ev["found_s"]["p50"], 1)
        if "fleet" in opts.groups:
            report["fleet"] = await asyncio.to_thread(_fleet, opts, srv, root, say)
        if "listing" in opts.groups:
            report["listing"] = await _listing(opts, srv, say)
        if "route" in opts.groups:
            report["route"] = await asyncio.to_thread(run_route, opts, srv, root, say)
        report["run_id"] = uuid.uuid4().hex[:8]
    return report


def fleet_table(report: dict[str, Any], markdown: bool = False) -> str:
    """The figures as a small table."""
    rows: list[tuple[str, str]] = []
    for mode, fo in (report.get("fanout") or {}).items():
        if not isinstance(fo, dict):
            continue
        st = fo.get("found_s")
        how = "events (discovery)" if mode == "events" else f"probes only (negative TTL {fo['negative_ttl_s']:g} s)"
        val = (f"p50 {st['p50'] * 1e3:.1f} ms, p95 {st['p95'] * 1e3:.1f} ms, max {st['max'] * 1e3:.1f} ms "
               f"({fo['samples']} finds)" if st else "never found")
        val += f"; {fo['never_found']} never, {fo['wrong_bytes']} wrong bytes"
        if fo.get("killed"):
            val += f"; {fo['killed']['server']} killed at round {fo['killed']['at_round']}, {fo['refused']} refused"
        rows.append((f"{fo['daemons']} daemons: store -> found by every other, {how}", val))
    f = report.get("fleet")
    if f:
        ah = f.get("ack_to_hit_s")
        found = (f"p50 {ah['p50'] * 1e3:.1f} ms, p99 {ah['p99'] * 1e3:.1f} ms ({f['found']}/{f['blocks']})"
                 if ah else "never found")
        rows.append(("ack -> hit on another daemon",
                     found + (f", {f['never_found']} never found" if f.get("never_found") else "")))
        rows.append(("lookup miss / G2 hit (p50)",
                     f"{f['lookup_miss_s']['p50'] * 1e6:.0f} us / {f['lookup_hit_g2_s']['p50'] * 1e6:.0f} us"))
    rows += route_rows(report.get("route"))
    for r in report.get("listing", []):
        rows.append((f"list {r['objects']:,} block objects",
                     f"serial {r['serial']['seconds']:.2f} s, parallel {r['parallel']['seconds']:.2f} s"))
    if markdown:
        return "\n".join(["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
    w = max((len(a) for a, _ in rows), default=0)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
