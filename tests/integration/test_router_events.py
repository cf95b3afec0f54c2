"""Router events: a real `kvbm serve` publishes its block residency per tier as vLLM KV events, decoded here with
vLLM's own classes (``vllm.distributed.kv_events``) the way a KV-aware router follows an engine: a SUB socket for
the live stream, the replay socket to fill a gap or to start from 0. After every store, write-through, eviction,
purge and restart, what the stream says each tier holds is what the daemon says it holds."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from click.testing import CliRunner
from needs import needs
from serve_proc import ServeProc, wait_until

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.cli.main import main
from kvbm.client import WorkerClient
from kvbm.config import load_config
from kvbm.config.schema import RouterEventsConfig
from kvbm.daemon.router_events import RouterEventPublisher, check_bind
from kvbm.errors import ConfigError
from kvbm.index.registry import Registry

pytestmark = needs("vllm", importlib.util.find_spec("vllm") is not None, "decoding needs vLLM's event classes")

LAYOUT = KVLayout(model="router", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
WAIT_S = 30.0  # generous deadline for the poll loops; the assertions are "agrees", never a time
TIERS = {"G2": ("CPU", "LOCAL"), "G3": ("STORAGE", "LOCAL"), "G4": ("STORAGE", "REMOTE")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RouterView:
    """What a router knows of one node: hashes per (medium, locality, ownership), from the live stream and replays.

    Every batch is decoded with vLLM's ``KVEventBatch`` decoder; sequence numbers must run without a hole once
    replays have filled the gaps (a batch lost for good fails the test)."""

    def __init__(self, endpoint: str, replay: str, topic: bytes = b"") -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        self._classes = (AllBlocksCleared, BlockRemoved, BlockStored)
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_ep, self.topic = replay, topic
        self.held: dict[tuple[Any, ...], set[bytes]] = {}
        self.last = -1
        self.cleared = 0
        self.events: list[Any] = []
        self.replays = 0
        self.fill()  # a router joining late starts from 0

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def fill(self) -> None:
        """Ask the replay socket for every batch after the last one applied."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_ep)
        dealer.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "the replay socket did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            assert topic == self.topic
            self._apply(int.from_bytes(seq, "big"), payload)
        dealer.close(0)
        self.replays += 1

    def pump(self) -> RouterView:
        """Apply every live batch waiting (filling a gap from the replay socket first)."""
        while self.sub.poll(0):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq_b, "big")
            if seq <= self.last:
                continue  # already had it from a replay
            if seq > self.last + 1:
                self.fill()
            if seq == self.last + 1:
                self._apply(seq, payload)
        return self

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.last + 1, f"batch {seq} after {self.last}: a hole in the stream"
        self.last = seq
        cleared, removed, stored = self._classes
        for ev in self._decode(payload).events:
            self.events.append(ev)
            if isinstance(ev, cleared):
                self.held.clear()
                self.cleared += 1
                continue
            tier = (ev.medium, ev.locality, ev.ownership)
            if isinstance(ev, stored):
                assert len(ev.block_hashes) == 1 and ev.parent_block_hash is None and ev.token_ids == []
                self.held.setdefault(tier, set()).update(ev.block_hashes)
            else:
                assert isinstance(ev, removed)
                self.held.setdefault(tier, set()).difference_update(ev.block_hashes)

    def tier(self, name: str) -> set[bytes]:
        return self.held.get((*TIERS[name], f"kvbm/{name}"), set())


def payload(k: BlockKey) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(k.hash[:8], "little"))
    return rng.integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


def store(c: WorkerClient, keys: list[BlockKey]) -> None:
    assert c.store(keys, [payload(k) for k in keys], durable=True).durable == len(keys)


def agrees(view: RouterView, c: WorkerClient, keys: list[BlockKey]) -> bool:
    """The stream's view of every tier is what the daemon holds: the same block count as its Stats, only hashes it
    was given, and for each key whose fastest tier Lookup names, that tier holds it in the view (and no faster
    one does)."""
    view.pump()
    counts = {t["tier"]: t["blocks"] for t in c.stats()["tiers"]}
    given = {k.hash for k in keys}
    if any(len(view.tier(t)) != counts[t] or not view.tier(t) <= given for t in TIERS):
        return False
    order = list(TIERS)
    for k in keys:
        rep = c.lookup([k])
        fastest = rep.tiers[0] if rep.matched else None
        for t in order[: order.index(fastest)] if fastest else order:
            if k.hash in view.tier(t):
                return False
        if fastest is not None and k.hash not in view.tier(fastest):
            return False
    return True


@pytest.fixture
def node(tmp_path: Path, s3_server, s3_prefix):
    ports = free_port(), free_port()
    cfg = {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "16MiB", "fsync": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": f"ipc://{tmp_path}/e.sock",
                   "metrics_port": 0, "prefetch": False, "probe": False, "index_bucket": "start"},
        "router_events": {"endpoint": f"tcp://127.0.0.1:{ports[0]}", "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
                          "topic": "kv@node-a@router"},
    }
    proc = ServeProc(tmp_path, cfg)
    yield proc
    proc.stop()


def client(proc: ServeProc) -> WorkerClient:
    c = proc.client(admin=True)
    c.register(LAYOUT, worker_id="w")
    return c


@pytest.mark.s3
def test_router_sees_g2_g3_g4_through_stores_evictions_purge_and_restart(node):
    proc = node.start()
    rc = json.loads(proc.cfg_path.read_text())["router_events"]
    view = RouterView(rc["endpoint"], rc["replay_endpoint"], b"kv@node-a@router")
    keys = [BlockKey(LAYOUT.namespace, os.urandom(32)) for _ in range(24)]
    try:
        with client(proc) as c:
            # Stores are written through: each block is stored in G2, G3 and G4, with its tier's medium.
            store(c, keys[:8])
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            assert all(len(view.tier(t)) == 8 for t in TIERS)
            # More than G2 holds (16 slots): G2 evicts its least recently used; G3 and G4 keep everything.
            store(c, keys[8:])
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            assert len(view.tier("G2")) == 16 and len(view.tier("G3")) == len(view.tier("G4")) == 24
            # Evictions from one tier are removals of that tier only.
            assert c.evict(keys[:4], tiers=["G3"]).removed == 4
            assert c.evict(keys[4:6], tiers=["G4"]).removed == 2
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            assert len(view.tier("G3")) == 20 and len(view.tier("G4")) == 22
            # A router joining now (replay from 0: the first state, then every change) knows the same.
            late = RouterView(rc["endpoint"], rc["replay_endpoint"], b"kv@node-a@router")
            assert late.pump().held == view.pump().held and late.cleared == 1
            late.close()
            # kvbm purge deletes G3 and G4 and tells the daemon: removals of those tiers.
            r = CliRunner().invoke(main, ["purge", "--all", "--yes", "--json"], env={"KVBM_CONFIG": str(proc.cfg_path)},
                                   catch_exceptions=False)
            assert r.exit_code == 0, r.output
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            assert not view.tier("G3") and not view.tier("G4") and view.tier("G2")
            store(c, keys[:4])
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            st = c.stats()["daemon"]["router_events"]
            assert st["dropped"] == 0 and st["stored"] >= 24 * 3 and st["removed"] >= 8
            # and an operator sees the stream's counters in `kvbm status --json`
            r = CliRunner().invoke(main, ["status", "--json"], env={"KVBM_CONFIG": str(proc.cfg_path)},
                                   catch_exceptions=False)
            shown = json.loads(r.output)["router_events"]
            assert shown["endpoint"] == rc["endpoint"] and shown["stored"] >= st["stored"], shown
            # (G2 evictions since the purge demoted to G3, which no longer held them: G3 may hold more than G4.)
            persistent = {t: set(view.tier(t)) for t in ("G3", "G4")}
            assert len(persistent["G4"]) == 4
        # Restart: the new stream starts with AllBlocksCleared and every block the daemon found on disk and in the
        # bucket; G2 (shared memory) starts empty.
        proc.stop()
        view.close()
        proc.start()
        view = RouterView(rc["endpoint"], rc["replay_endpoint"], b"kv@node-a@router")
        with client(proc) as c:
            assert wait_until(lambda: agrees(view, c, keys), WAIT_S)
            assert isinstance(view.events[0], view._classes[0]) and view.cleared == 1
            assert not view.tier("G2") and {t: view.tier(t) for t in ("G3", "G4")} == persistent
    finally:
        view.close()


def test_router_events_refused_where_they_would_leak(tmp_path):
    """The stream is unauthenticated (vLLM's format): not on a daemon with tenants, not off this host unless the
    operator allows insecure TCP; malformed endpoints are errors naming the field."""
    def cfg(**env: str):
        return load_config(environ={f"KVBM_{k.upper()}": v for k, v in env.items()})

    with pytest.raises(ConfigError, match=r"router_events\.endpoint: 'http://x' is not a tcp"):
        cfg(router_events_endpoint="http://x")
    with pytest.raises(ConfigError, match=r"router_events\.replay_endpoint: needs router_events\.endpoint"):
        cfg(router_events_replay_endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"router_events\.buffer_steps: must be >= 1"):
        cfg(router_events_endpoint="tcp://127.0.0.1:1", router_events_buffer_steps="0")
    c = cfg(router_events_endpoint="tcp://0.0.0.0:5557")
    with pytest.raises(ConfigError, match=r"router_events\.endpoint tcp://0\.0\.0\.0:5557 is reachable"):
        check_bind(c.router_events, c.daemon)
    c = cfg(router_events_endpoint="tcp://0.0.0.0:5557", daemon_allow_insecure_tcp="true")
    check_bind(c.router_events, c.daemon)
    c = cfg(router_events_endpoint="tcp://127.0.0.1:5557",
            daemon_tenants=f"[{{name: a, token_file: {tmp_path}/a.token, models: ['*']}}]")
    with pytest.raises(ConfigError, match=r"router_events\.endpoint: a daemon with tenants"):
        check_bind(c.router_events, c.daemon)
    # A deep work dir's socket path: refused naming the field (zmq's own error was a traceback at bind).
    c = cfg(router_events_endpoint="ipc://" + "/tmp/" + "d" * 100 + "/r.sock")
    with pytest.raises(ConfigError, match=r"router_events\.endpoint ipc:///tmp/d+/r\.sock: an ipc:// path is at most"):
        check_bind(c.router_events, c.daemon)


@pytest.mark.s3
def test_bench_fleet_route_prefix_tiny(s3_server, tmp_path):
    """``kvbm bench fleet --route prefix`` runs both policies on two real daemons and accounts for every block of
    every request (served from a tier or recomputed); a benchmark, so no figure is asserted."""
    from kvbm.cli.bench import bench

    out = tmp_path / "route.json"
    res = CliRunner().invoke(bench, ["fleet", "--route", "prefix", "--route-requests", "12", "--workdir",
                                     str(tmp_path), "--json", str(out), "--s3-endpoint", s3_server.endpoint,
                                     "--s3-access-key", s3_server.access_key, "--s3-secret-key",
                                     s3_server.secret_key, "--s3-bucket", s3_server.bucket], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["route"]
    per_request = r["prefix_blocks"] + r["own_blocks"]
    for policy in ("random", "prefix"):
        p = r[policy]
        assert sum(p["served_blocks"].values()) + p["recomputed_blocks"] == 12 * per_request
        assert sum(p["requests_per_node"]) == 12 and p["time_to_prefix_s"]["n"] == 12
    assert r["prefix"]["replays"] >= 2  # each node's stream was started from 0 through its replay socket
    assert "route prefix: blocks from G2 / G3 / G4 / recomputed" in res.output


def test_int_hashes_namespaces_and_the_replay_bound(tmp_path):
    """A registry's changes on a publisher bound here: ``int_hashes`` sends vLLM's 64-bit int form, ``namespaces``
    keeps other namespaces out, and the replay buffer keeps only the last ``buffer_steps`` batches."""
    rc = RouterEventsConfig(endpoint=f"ipc://{tmp_path}/r.sock", replay_endpoint=f"ipc://{tmp_path}/rr.sock",
                            int_hashes=True, namespaces=["ns-a"], buffer_steps=3)
    reg = Registry(["G2", "G3"])
    a = [BlockKey("ns-a", os.urandom(32)) for _ in range(3)]
    b = [BlockKey("ns-b", os.urandom(32)) for _ in range(2)]

    async def go() -> list[tuple[int, Any]]:
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task[Any]] = []
        pub = RouterEventPublisher(rc, reg, {"G2": "host", "G3": "disk"})
        pub.bind(ctx, lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1])
        for k in a + b:  # one batch each (a turn of the loop between them)
            reg.add("G2", k, 1)
            await asyncio.sleep(0)
        reg.remove("G2", a[0])
        await asyncio.sleep(0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(rc.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            _, _topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), WAIT_S)
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            got.append((int.from_bytes(seq, "big"), payload))
        dealer.close(0)
        pub.close()
        for t in tasks:
            t.cancel()
        ctx.term()
        return got

    from vllm.distributed.kv_events import KVEventBatch

    got = asyncio.run(go())
    # Batches: 0 AllBlocksCleared (empty tiers: nothing more), 1-3 a's stores (b's are filtered out: no batch),
    # 4 a[0]'s removal; the buffer keeps the last 3.
    assert [seq for seq, _ in got] == [2, 3, 4]
    events = [ev for _, p in got for ev in msgspec.msgpack.decode(p, type=KVEventBatch).events]
    ints = [int.from_bytes(k.hash, "big") & ((1 << 64) - 1) for k in a]
    assert [(type(ev).__name__, ev.block_hashes, ev.medium, ev.ownership) for ev in events] == [
        ("BlockStored", [ints[1]], "CPU", "kvbm/G2"), ("BlockStored", [ints[2]], "CPU", "kvbm/G2"),
        ("BlockRemoved", [ints[0]], "CPU", "kvbm/G2")]
