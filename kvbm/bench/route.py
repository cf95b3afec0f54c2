"""``kvbm bench fleet --route prefix``: routing requests on kvbm's router events vs at random, on a two-node fleet.

Two daemons share one bucket; each has its own G2 and G3 and publishes its residency as vLLM KV events
(``router_events``, :mod:`kvbm.daemon.router_events`). A request is a prompt whose leading blocks are one of
``prefixes`` shared documents (chosen by a seeded Zipf-like draw) and the rest its own. Each request is sent to one
node; there it is looked up, its leading run loaded (timed: lookup + load), and the blocks it did not find stored as
the engine would after computing them. Policies, each on a fresh fleet with the same requests:

* ``random``: a node drawn at random (seeded);
* ``prefix``: the router follows both nodes' event streams (SUB, gaps filled from the replay socket) and sends the
  request to the node holding the longest leading run, each block weighed by the fastest tier holding it there
  (G2 3, G3 2, G4 1: G4 is the bucket both nodes read, so it rarely decides); a tie (say nothing held anywhere)
  goes to the node with fewer requests so far.

Figures per policy: blocks served from G2, G3, G4 and recomputed (stored), time to a request's prefix (lookup +
load, p50/p90), and requests per node.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvbm.bench.common import DaemonProc, delete_prefix, summary
from kvbm.daemon.launch import ipc_endpoint
from kvbm.daemon.router_events import AllBlocksCleared, BlockStored, KVEventBatch

WEIGHTS = {"kvbm/G2": 3, "kvbm/G3": 2, "kvbm/G4": 1}
NODES = 2


class NodeView:
    """What the router knows of one node, from its router-events stream: hashes per ``ownership`` (kvbm tier)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.ctx, self.replay = ctx, replay
        self.held: dict[str, set[bytes]] = {t: set() for t in WEIGHTS}
        self.last = -1
        self.replays = 0
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def fill(self) -> None:
        """Every batch after the last one applied, from the replay socket."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        dealer.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
        try:
            while dealer.poll(10_000):
                _, _topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    self.replays += 1
                    return
                self._apply(int.from_bytes(seq, "big"), payload)
            raise RuntimeError(f"replay socket {self.replay} did not answer in 10 s")
        finally:
            dealer.close(0)

    def pump(self) -> None:
        while self.sub.poll(0):
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.last + 1:
                self.fill()
            if seq == self.last + 1:
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last = seq
        for ev in self._decode(payload).events:
            if isinstance(ev, AllBlocksCleared):
                for s in self.held.values():
                    s.clear()
            elif ev.ownership in self.held:
                if isinstance(ev, BlockStored):
                    self.held[ev.ownership].update(ev.block_hashes)  # type: ignore[arg-type]
                else:
                    self.held[ev.ownership].difference_update(ev.block_hashes)  # type: ignore[arg-type]

    def score(self, hashes: list[bytes]) -> int:
        """The leading run held in any tier, each block weighed by its fastest tier here."""
        total = 0
        for h in hashes:
            w = next((w for t, w in WEIGHTS.items() if h in self.held[t]), 0)
            if not w:
                break
            total += w
        return total


def _cfg(root: Path, srv: dict[str, Any], prefix: str, block_bytes: int, i: int, g2_blocks: int,
         g3_blocks: int) -> dict[str, Any]:
    return {
        "block_bytes": block_bytes, "device": {"enabled": False},
        "host": {"capacity": g2_blocks * block_bytes, "pin": False},
        "disk": {"dir": str(root / f"disk{i}"), "capacity": g3_blocks * block_bytes, "fsync": False,
                 "o_direct": False},
        "s3": {"endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": prefix,
               "access_key": srv["access_key"], "secret_key": srv["secret_key"]},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": ipc_endpoint(root, f"d{i}.sock"), "events_endpoint": "", "metrics_port": 0,
                   "node_id": f"route-{i}", "prefetch": False},
        "router_events": {"endpoint": ipc_endpoint(root, f"r{i}.sock"),
                          "replay_endpoint": ipc_endpoint(root, f"r{i}-replay.sock")},
    }


def _requests(opts: Any, seed: int) -> list[tuple[int, int]]:
    """(prefix index, own blocks) per request: prefix i drawn with weight 1/(i+1)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(opts.route_prefixes)]
    return [(rng.choices(range(opts.route_prefixes), weights)[0], opts.route_own_blocks)
            for _ in range(opts.route_requests)]


def _one_policy(policy: str, opts: Any, srv: dict[str, Any], root: Path, say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from kvbm.blocks import BlockKey
    from kvbm.blocks.layout import KVLayout
    from kvbm.client import WorkerClient

    layout = KVLayout(model="bench-route", num_layers=1, num_kv_heads=1, head_size=opts.block_bytes // 2,
                      dtype="uint8", kv_factor=2, tokens_per_block=1, block_bytes=opts.block_bytes)
    ns = layout.namespace
    docs = [[BlockKey(ns, os.urandom(16)) for _ in range(opts.route_prefix_blocks)] for _ in range(opts.route_prefixes)]
    reqs = _requests(opts, opts.route_seed)
    base = root / policy
    prefix = f"{srv['prefix']}-route-{policy}"
    daemons = [DaemonProc(base / f"n{i}", _cfg(base, srv, prefix, opts.block_bytes, i, opts.route_g2_blocks,
                                               opts.route_g3_blocks), f"n{i}") for i in range(NODES)]
    ctx: zmq.Context[Any] = zmq.Context()
    clients: list[WorkerClient] = []
    served = {"G2": 0, "G3": 0, "G4": 0}
    recomputed = 0
    per_node = [0] * NODES
    ttp: list[float] = []
    rng = random.Random(opts.route_seed + 1)
    buf = np.frombuffer(os.urandom(opts.block_bytes), np.uint8)
    outs = [np.empty(opts.block_bytes, np.uint8) for _ in range(opts.route_prefix_blocks + opts.route_own_blocks)]
    try:
        for d in daemons:
            d.start()
        views = []
        for i, d in enumerate(daemons):
            c = WorkerClient(d.endpoint, timeout_s=30.0)
            c.register(layout, worker_id=f"route-{i}")
            clients.append(c)
            rc = _cfg(base, srv, prefix, opts.block_bytes, i, 1, 1)["router_events"]
            v = NodeView(ctx, rc["endpoint"], rc["replay_endpoint"])
            v.fill()
            views.append(v)
        for doc, own in reqs:
            keys = docs[doc] + [BlockKey(ns, os.urandom(16)) for _ in range(own)]
            if policy == "prefix":
                for v in views:
                    v.pump()
                hashes = [k.hash for k in keys]
                scores = [v.score(hashes) for v in views]
                best = max(scores)
                tied = [i for i, s in enumerate(scores) if s == best]
                node = min(tied, key=lambda i: (per_node[i], i))
            else:
                node = rng.randrange(NODES)
            per_node[node] += 1
            c = clients[node]
            t0 = time.perf_counter()
            rep = c.lookup(keys)
            n = c.load(keys[: rep.matched], outs[: rep.matched]) if rep.matched else 0
            ttp.append(time.perf_counter() - t0)
            for t in rep.tiers[:n]:
                served[t] = served.get(t, 0) + 1
            if n < len(keys):
                c.store(keys[n:], [buf] * (len(keys) - n))
                recomputed += len(keys) - n
        out = {"requests": len(reqs), "served_blocks": served, "recomputed_blocks": recomputed,
               "requests_per_node": per_node, "time_to_prefix_s": summary(ttp),
               "replays": sum(v.replays for v in views)}
        say(f"route {policy}: G2 {served['G2']} G3 {served['G3']} G4 {served['G4']} blocks served, {recomputed} "
            f"recomputed; time to prefix p50 {summary(ttp)['p50'] * 1e3:.2f} ms; per node {per_node}")
        return out
    finally:
        for c in clients:
            c.close()
        ctx.destroy(linger=0)
        for d in daemons:
            d.stop()
        delete_prefix(srv, prefix + "/")


def run_route(opts: Any, srv: dict[str, Any], root: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Both policies on fresh fleets with the same requests; ``opts`` is a FleetOptions."""
    out: dict[str, Any] = {"nodes": NODES, "prefixes": opts.route_prefixes, "prefix_blocks": opts.route_prefix_blocks,
                           "own_blocks": opts.route_own_blocks, "g2_blocks": opts.route_g2_blocks,
                           "g3_blocks": opts.route_g3_blocks, "seed": opts.route_seed}
    for policy in ("random", "prefix"):
        out[policy] = _one_policy(policy, opts, srv, root, say)
    r, p = out["random"], out["prefix"]
    local = {k: v["served_blocks"]["G2"] + v["served_blocks"]["G3"] for k, v in (("random", r), ("prefix", p))}
    out["local_blocks_prefix_over_random"] = round(local["prefix"] / local["random"], 2) if local["random"] else None
    return out


def route_rows(r: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Table rows of the route group (none when it did not run)."""
    if not r:
        return []
    rows = []
    for policy in ("random", "prefix"):
        p = r[policy]
        sb, tp = p["served_blocks"], p["time_to_prefix_s"]
        rows.append((f"route {policy}: blocks from G2 / G3 / G4 / recomputed",
                     f"{sb['G2']} / {sb['G3']} / {sb['G4']} / {p['recomputed_blocks']}; time to prefix p50 "
                     f"{tp['p50'] * 1e3:.2f} ms, p90 {tp['p90'] * 1e3:.2f} ms; per node {p['requests_per_node']}"))
    rows.append(("route: local (G2+G3) blocks, prefix over random", f"{r['local_blocks_prefix_over_random']}x"))
    return rows
