"""``kvbm bench p2p``: blocks node A holds in G2, loaded by node B from A over NIXL (peer read) vs from the bucket.

Three daemons on loopback, one embedded SeaweedFS: A stores ``blocks`` blocks durably (so they sit in A's G2 and
in the bucket); B (``fleet.p2p``, following A) loads them through a peer read; C (no peer reads, following A)
loads them from the bucket. Each repeat first drops B's and C's G2 copies, then times a worker's lookup plus load
of the whole prefix on each (the time to the last block in the worker's buffer) and reports GB/s and that time,
medians of the repeats. Every transport in ``transports`` is a fresh set of daemons with ``UCX_TLS`` set for it
(``default``: unset, UCX picks; on loopback that is shared memory/CMA). Every block loaded is checked byte-exact.
RDMA needs hardware this machine does not have: not run here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbm.bench.common import DaemonProc, delete_prefix, load_avg, machine, median, s3_server, temp_dir
from kvbm.daemon.launch import ipc_endpoint

TRANSPORTS = {"default": None, "tcp": "tcp"}  # name -> UCX_TLS (None: unset)


@dataclass
class P2POptions:
    blocks: int = 32
    block_bytes: int = 8 << 20
    repeats: int = 3
    transports: list[str] = field(default_factory=lambda: ["default", "tcp"])
    root: str | None = None


def node_config(root: Path, srv: dict[str, Any], prefix: str, name: str, *, block_bytes: int, capacity: int,
                p2p: bool, peers: list[str], budget_ms: float = 120_000, lease_ms: float = 120_000,
                max_blocks: int = 256) -> dict[str, Any]:
    """One node's daemon on loopback: G2 of ``capacity`` bytes, no disk, the bench bucket under ``prefix``,
    following ``peers``' events, peer reads on or off."""
    return {
        "block_bytes": block_bytes, "device": {"enabled": False},
        "host": {"capacity": capacity, "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": prefix,
               "access_key": srv["access_key"], "secret_key": srv["secret_key"]},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": ipc_endpoint(root, f"{name}.sock"), "events_endpoint": "tcp://127.0.0.1:0",
                   "metrics_port": 0, "node_id": name, "peers": peers, "admin_token_file": str(root / "admin.token"),
                   "prefetch": False},
        "fleet": {"p2p": p2p, "peer_read_budget_ms": budget_ms, "peer_read_lease_ms": lease_ms,
                  "peer_read_max_blocks": max_blocks},
    }


def _cfg(root: Path, srv: dict[str, Any], prefix: str, opts: P2POptions, name: str, *, p2p: bool,
         peers: list[str]) -> dict[str, Any]:
    return node_config(root, srv, prefix, name, block_bytes=opts.block_bytes,
                       capacity=(opts.blocks + 8) * opts.block_bytes, p2p=p2p, peers=peers,
                       max_blocks=max(opts.blocks, 1))


@contextlib.contextmanager
def _ucx(tls: str | None) -> Iterator[None]:
    old = os.environ.get("UCX_TLS")
    if tls is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = tls
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


def events_endpoint(d: DaemonProc) -> str:
    import json

    for line in d.log_path.read_text().splitlines():
        if '"daemon.started"' in line:
            return str(json.loads(line)["events"])
    raise RuntimeError(f"{d.name} logged no events endpoint")


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


# Stage timers of one peer load: B's (the asker's) read stages and A's (the server's) pin stages, in seconds.
_READ_STAGES = ("pin", "prepare", "read", "verify", "commit")
_SERVE_STAGES = ("reserve", "checksum")


def _stage_stats(fleet_b: dict[str, Any], fleet_a: dict[str, Any]) -> dict[str, float]:
    rd, sv = fleet_b["p2p"]["read"], fleet_a["p2p"]["serve"]
    got = {f"b_{k}_s": float(rd[f"{k}_seconds"]) for k in _READ_STAGES}
    got.update({f"a_{k}_s": float(sv[f"{k}_seconds"]) for k in _SERVE_STAGES})
    got["a_checksums_computed"] = float(sv["checksums_computed"])
    return got


def _one_transport(opts: P2POptions, srv: dict[str, Any], root: Path, tls: str | None,
                   say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from kvbm.blocks import BlockKey
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import WorkerClient

    layout = KVLayout(model="bench-p2p", num_layers=1, num_kv_heads=1, head_size=opts.block_bytes // 2,
                      dtype="uint8", kv_factor=2, tokens_per_block=1, block_bytes=opts.block_bytes)
    prefix = f"{srv['prefix']}-p2p-{root.name}"
    out: dict[str, Any] = {"ucx_tls": tls or "(unset: UCX picks)"}
    daemons: list[DaemonProc] = []
    clients: list[WorkerClient] = []
    try:
        with _ucx(tls):
            a = DaemonProc(root / "a", _cfg(root / "a", srv, prefix, opts, "a", p2p=True, peers=[]), "a")
            a.start()
            daemons.append(a)
            ev = events_endpoint(a)
            b = DaemonProc(root / "b", _cfg(root / "b", srv, prefix, opts, "b", p2p=True, peers=[ev]), "b")
            c = DaemonProc(root / "c", _cfg(root / "c", srv, prefix, opts, "c", p2p=False, peers=[ev]), "c")
            for d in (b, c):
                d.start()
                daemons.append(d)
        ca, cb, cc = (WorkerClient(d.endpoint, timeout_s=300.0) for d in (a, b, c))
        clients += [ca, cb, cc]
        for i, cl in enumerate(clients):
            cl.register(layout, worker_id=f"bench-{i}")
        admins = []
        for d in (b, c):
            adm = WorkerClient(d.endpoint, timeout_s=60.0, admin_token=(d.cfg_path.parent / "admin.token")
                               .read_text().strip())
            adm.register(layout, worker_id=f"admin-{d.name}")
            admins.append(adm)
            clients.append(adm)

        def fleet(cl: WorkerClient) -> dict[str, Any]:
            return dict(cl.stats()["daemon"]["fleet"])

        wait_for(lambda: fleet(cb)["p2p"]["serve"] is not None and fleet(cb)["peers"][0]["p2p_endpoint"]
                 and fleet(cb)["peers"][0]["connected"], 120, "B to follow A and start its NIXL agent")
        wait_for(lambda: fleet(cc)["peers"][0]["connected"], 120, "C to follow A")
        ns = layout.namespace
        keys = [BlockKey(ns, os.urandom(16)) for _ in range(opts.blocks)]
        bufs = [np.frombuffer(os.urandom(opts.block_bytes), np.uint8) for _ in keys]
        t0 = time.perf_counter()
        assert ca.store(keys, bufs, durable=True).durable == len(keys)
        out["store_durable_s"] = time.perf_counter() - t0
        wait_for(lambda: fleet(cb)["peers"][0]["resident"] >= len(keys), 120, "B to learn A's blocks")
        wait_for(lambda: cc.lookup(keys).matched == len(keys), 120, "C to learn A's blocks")
        # First contact (Connect, NIXL metadata both ways, the UCX connection): one block, timed apart.
        warm = [BlockKey(ns, os.urandom(16))]
        assert ca.store(warm, [bufs[0]], durable=True).durable == 1
        wait_for(lambda: fleet(cb)["peers"][0]["resident"] >= len(keys) + 1, 120, "B to learn the first-contact block")
        t0 = time.perf_counter()
        if cb.lookup(warm).tiers != ["G2"]:
            raise RuntimeError("peer: the first-contact lookup did not read from the peer")
        out["first_contact_lookup_s"] = time.perf_counter() - t0
        outs = [np.zeros(opts.block_bytes, np.uint8) for _ in keys]
        nbytes = len(keys) * opts.block_bytes
        runs: dict[str, list[float]] = {"peer": [], "bucket": []}
        stages: dict[str, list[dict[str, float]]] = {"peer": [], "bucket": []}
        for r in range(opts.repeats):
            for path, cl, adm in (("peer", cb, admins[0]), ("bucket", cc, admins[1])):
                adm.evict(keys, tiers=["G2"])
                for o in outs:
                    o[:] = 0
                before = _stage_stats(fleet(cb), fleet(ca)) if path == "peer" else {}
                t0 = time.perf_counter()
                tiers = cl.lookup(keys).tiers
                t1 = time.perf_counter()
                n = cl.load(keys, outs)
                took = time.perf_counter() - t0
                if n != len(keys) or any(not np.array_equal(o, bb) for o, bb in zip(outs, bufs, strict=True)):
                    raise RuntimeError(f"{path}: {n} of {len(keys)} blocks loaded, or wrong bytes")
                if path == "peer" and tiers != ["G2"] * len(keys):
                    raise RuntimeError(f"peer: the lookup did not read from the peer (tiers {set(tiers)})")
                st = {"lookup_s": t1 - t0, "load_s": took - (t1 - t0)}
                if path == "peer":
                    after = _stage_stats(fleet(cb), fleet(ca))
                    st.update({k: after[k] - before[k] for k in after})
                runs[path].append(took)
                stages[path].append(st)
                say(f"  {out['ucx_tls']} repeat {r + 1}: {path} {took * 1e3:.0f} ms "
                    f"({nbytes / took / 1e9:.2f} GB/s; " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in st.items()
                                                                      if k.endswith("_s")) + " ms)")
        for path, xs in runs.items():
            med = median(xs)
            out[path] = {"time_to_last_block_s": med, "gbps": nbytes / med / 1e9, "runs_s": xs,
                         "stages_median_s": {k: median([st[k] for st in stages[path]]) for k in stages[path][0]},
                         "stages_s": stages[path]}
        out["peer_over_bucket"] = out["peer"]["gbps"] / out["bucket"]["gbps"]
        out["peer_read_stats"] = {k: v for k, v in fleet(cb)["p2p"]["read"].items() if k != "peers"}
        out["peer_serve_stats_on_a"] = {k: v for k, v in fleet(ca)["p2p"]["serve"].items()
                                        if isinstance(v, (int, float))}
        out["bucket_gets_on_c"] = next(t for t in cc.stats()["tiers"] if t["tier"] == "G4")["stats"]["gets"]
        out["bucket_gets_on_b"] = next(t for t in cb.stats()["tiers"] if t["tier"] == "G4")["stats"]["gets"]
    finally:
        for cl in clients:
            with contextlib.suppress(Exception):
                cl.close()
        for d in daemons:
            d.stop()
        delete_prefix(srv, prefix + "/")
    return out


def run_p2p(opts: P2POptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    report: dict[str, Any] = {"bench": "p2p", "machine": machine(), "options": asdict(opts), "load_before": load_avg(),
                              "rdma": "not run: no RDMA hardware here (UCX would use it with rc/ud/dc transports)"}
    unknown = [t for t in opts.transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"--transports: unknown {unknown}; choose from {sorted(TRANSPORTS)}")
    with temp_dir("kvbm-p2p-", opts.root) as tmp, s3_server(tmp) as srv:
        report["s3"] = "embedded SeaweedFS (fresh)"
        for name in opts.transports:
            say(f"transport {name}: {opts.blocks} x {opts.block_bytes >> 20} MiB, {opts.repeats} repeats")
            report[name] = _one_transport(opts, srv, tmp / name, TRANSPORTS[name], say)
    report["load_after"] = load_avg()
    return report


def p2p_table(report: dict[str, Any]) -> str:
    rows = ["| UCX transport | path | GB/s (median) | time to last block (median) |", "|---|---|---|---|"]
    for name in report["options"]["transports"]:
        r = report.get(name)
        if not r:
            continue
        for path in ("peer", "bucket"):
            got = r[path]
            rows.append(f"| {r['ucx_tls']} | {path} | {got['gbps']:.2f} | {got['time_to_last_block_s'] * 1e3:.0f} ms |")
    return "\n".join(rows)
