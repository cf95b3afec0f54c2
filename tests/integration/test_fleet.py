"""Many daemons, one bucket: a block stored by one node is found by the others (bucket probes, peer events),
and a block deleted from the bucket leaves every node's index (peer events, a 404 on GET)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio
from click.testing import CliRunner
from needs import needs
from serve_proc import ServeProc, wait_until

from kvbm.bench.openai_server import free_port as _free_port
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.cli.main import main
from kvbm.client import WorkerClient
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

LAYOUT = KVLayout(model="fleet", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
WAIT_S = 30.0  # generous deadline for the poll loops; the assertions are "found", never a time


def free_port() -> int:
    return _free_port()  # not from the kernel's ephemeral range (kvbm.bench.openai_server)


class Node:
    """One daemon of the fleet: its own G2 pool, disk directory and sockets; the shared bucket and prefix."""

    def __init__(self, tmp: Path, name: str, srv, prefix: str, **daemon) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.cfg = {
            "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
            "disk": {"dir": str(self.dir / "disk"), "capacity": "16MiB", "fsync": False},
            "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
                   "secret_key": srv.secret_key},
            "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"ipc://{self.dir}/d.sock", "events_endpoint": self.events, "metrics_port": 0,
                       **daemon},
        }
        self.proc: ServeProc | None = None

    def start(self) -> Node:
        self.proc = ServeProc(self.dir, self.cfg).start()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def client(self, *, admin: bool = False, keypair: tuple[bytes, bytes] | None = None) -> WorkerClient:
        """A registered worker client (``admin``: with the daemon's admin token, as `kvbm purge` has it)."""
        assert self.proc is not None
        c = self.proc.client(admin=admin, curve_server_key=self.cfg["daemon"].get("curve_public_key", ""),
                             curve_keypair=keypair)
        c.register(LAYOUT, worker_id=f"w-{self.dir.name}")
        return c


def prompt(n: int) -> list[BlockKey]:
    return [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(n)]


def payload(k: BlockKey) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(k.hash[:8], "little"))
    return rng.integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


def outs(n: int) -> list[np.ndarray]:
    return [np.zeros(LAYOUT.block_nbytes, dtype=np.uint8) for _ in range(n)]


def store(c: WorkerClient, keys: list[BlockKey]) -> None:
    ack = c.store(keys, [payload(k) for k in keys], durable=True)
    assert ack.durable == len(keys)


def loads_exact(c: WorkerClient, keys: list[BlockKey]) -> int:
    """Load ``keys``; every block served must hold exactly the bytes stored. Returns blocks loaded."""
    bufs = outs(len(keys))
    n = c.load(keys, bufs)
    for k, b in zip(keys[:n], bufs[:n], strict=True):
        assert np.array_equal(b, payload(k)), f"wrong bytes served for {k}"
    return n


def poll(pred, timeout: float = WAIT_S):
    return wait_until(pred, timeout)


def g4(c: WorkerClient) -> dict:
    return next(t for t in c.stats()["tiers"] if t["tier"] == "G4")


def fleet(c: WorkerClient) -> dict:
    return c.stats()["daemon"]["fleet"]


def following(c: WorkerClient, connects: int = 1) -> bool:
    """Whether every peer of ``c``'s daemon is connected (at least ``connects`` times). A PUB socket drops what
    it sends before a subscriber is connected: those blocks are for the probe to find, not the events."""
    return all(p["connected"] and p["connects"] >= connects for p in fleet(c)["peers"])


# -- bucket probes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget_ms", [5000, 0], ids=["waits-for-probe", "answers-at-once"])
def test_b_finds_a_blocks_through_the_bucket(tmp_path, s3_server, s3_prefix, nodes, budget_ms):
    """No peer events: B (started first, so its listing saw nothing) finds A's blocks by probing the bucket.
    With a budget the probe's answer is in the first reply; with none the first reply says what B knew
    (nothing) and the probe fills the index for the next lookup."""
    b = Node(tmp_path, "b", s3_server, s3_prefix, probe_budget_ms=budget_ms, probe_negative_ttl_s=60)
    nodes.append(b.start())
    a = Node(tmp_path, "a", s3_server, s3_prefix)
    nodes.append(a.start())
    keys = prompt(4)
    with a.client() as ca, b.client() as cb:
        store(ca, keys)
        first = cb.lookup(keys)
        if budget_ms:
            assert first.matched == 4 and first.tiers == ["G4"] * 4
            assert cb.stats()["daemon"]["prefetches"] == 1  # found blocks start the usual prefetch to G2
        else:
            assert first.matched == 0  # answered before the probe: B did not know yet
            assert poll(lambda: cb.lookup(keys).matched == 4)
        assert loads_exact(cb, keys) == 4
        f = fleet(cb)["probe"]
        assert f["found"] == 4 and f["hit_rate"] > 0


def test_a_hot_miss_costs_one_head_per_ttl(tmp_path, s3_server, s3_prefix, nodes):
    b = Node(tmp_path, "b", s3_server, s3_prefix, probe_budget_ms=5000, probe_negative_ttl_s=600)
    nodes.append(b.start())
    keys = prompt(1)
    with b.client() as cb:
        assert cb.lookup(keys).matched == 0
        heads = g4(cb)["stats"]["heads"]
        assert heads == 1
        for _ in range(20):
            assert cb.lookup(keys).matched == 0
        assert g4(cb)["stats"]["heads"] == heads
        f = fleet(cb)
        assert f["probe"]["negative_cache"] == 1 and f["probe"]["negative_hits"] == 20


def test_negative_cache_expires_after_its_ttl():
    from kvbm.fleet.probe import NegativeCache

    now = [0.0]
    nc = NegativeCache(ttl_s=2.0, max_entries=2, clock=lambda: now[0])
    k1, k2, k3 = prompt(3)
    nc.add(k1)
    assert nc.hit(k1) and not nc.hit(k2)
    now[0] = 1.9
    assert nc.hit(k1)
    now[0] = 2.1
    assert not nc.hit(k1) and len(nc) == 0  # expired: the next lookup probes again
    nc.add(k1)
    nc.add(k2)
    nc.add(k3)  # bounded: the oldest entry leaves
    assert len(nc) == 2 and not nc.hit(k1) and nc.hit(k3)
    nc.discard(k3)
    assert not nc.hit(k3)


def test_probe_api_heads_a_batch_and_404_is_a_miss(s3_server, s3_prefix):
    async def go() -> None:
        t = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix), s3_server.endpoint,
                         (s3_server.access_key, s3_server.secret_key))
        await t.start()
        try:
            there, gone = prompt(2)
            await t.put(there, b"x" * 1000)
            other = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix), s3_server.endpoint,
                                 (s3_server.access_key, s3_server.secret_key))
            await other.start()
            try:
                got = await other.exists_many([there, gone])
                assert got == {there: 1000, gone: None}
                assert other.stats.heads == 2 and other.nbytes(there) == 1000
                await t.delete(there)
                # A GET of an object deleted by another client is a miss that drops the index entry.
                assert await other.get_into(there, memoryview(bytearray(1000))) is None
                assert other.nbytes(there) is None and other.stats.errors == 0
            finally:
                await other.close()
        finally:
            await t.close()

    asyncio.run(go())


def test_a_block_purged_by_a_is_a_miss_on_b_at_the_first_read(tmp_path, s3_server, s3_prefix, nodes):
    """No peer events: B learned A's blocks by probe; A deletes the tail from the bucket; B's onboard of the
    vanished blocks returns the shorter run (no error), drops them from its index, and serves right bytes."""
    b = Node(tmp_path, "b", s3_server, s3_prefix, probe_budget_ms=5000, prefetch=False)
    nodes.append(b.start())
    a = Node(tmp_path, "a", s3_server, s3_prefix)
    nodes.append(a.start())
    keys = prompt(4)
    with a.client(admin=True) as ca, b.client() as cb:
        store(ca, keys)
        assert cb.lookup(keys).matched == 4
        assert ca.evict(keys[2:], tiers=["G2", "G3", "G4"]).removed >= 2
        assert loads_exact(cb, keys) == 2
        assert g4(cb)["stats"]["errors"] == 0
        assert cb.lookup(keys).matched == 2  # the probe of the vanished block misses too


# -- peer events -------------------------------------------------------------------------------------------
def test_peer_events_share_stores_and_purges(tmp_path, s3_server, s3_prefix, nodes):
    """B follows A's event stream: it learns A's G4 stores without a lookup (even of a prefix it just missed and
    negative-cached) and drops what A purges; nothing wrong is served."""
    a = Node(tmp_path, "a", s3_server, s3_prefix)
    b = Node(tmp_path, "b", s3_server, s3_prefix, peers=[a.events], probe_budget_ms=5000,
             probe_negative_ttl_s=600, prefetch=False)
    nodes.append(b.start())  # B first: it follows A once A binds (ZeroMQ reconnects)
    nodes.append(a.start())
    keys = prompt(4)
    with a.client(admin=True) as ca, b.client() as cb:
        assert poll(lambda: following(cb))
        assert cb.lookup(keys).matched == 0  # negative-cached for 10 minutes
        store(ca, keys)
        assert poll(lambda: g4(cb)["blocks"] == 4)
        rep = cb.lookup(keys)
        assert rep.matched == 4 and rep.tiers == ["G4"] * 4
        assert loads_exact(cb, keys[:2]) == 2
        peer = fleet(cb)["peers"][0]
        assert peer["endpoint"] == a.events and peer["stored"] >= 4
        assert ca.evict(keys, tiers=["G2", "G3", "G4"]).removed >= 4
        assert poll(lambda: g4(cb)["blocks"] == 0)
        rep = cb.lookup(keys)
        assert rep.matched == 2 and "G4" not in rep.tiers  # B's own G2 copies of the two it loaded
        assert loads_exact(cb, keys) == 2
        assert fleet(cb)["peers"][0]["removed"] >= 4
    # kvbm status shows the peers followed, the probe's hit rate and the negative cache.
    env = {"KVBM_CONFIG": str(b.proc.cfg_path)}
    rep = json.loads(CliRunner().invoke(main, ["status", "--json"], env=env, catch_exceptions=False).output)
    assert rep["fleet"]["peers"][0]["endpoint"] == a.events and rep["fleet"]["peers"][0]["connected"]
    assert rep["fleet"]["probe"]["negative_cache"] >= 1 and rep["fleet"]["probe"]["probed"] >= 4
    text = CliRunner().invoke(main, ["status"], env=env, catch_exceptions=False).output
    assert "fleet: 1 peers followed" in text and a.events in text and "negative cache" in text


def test_a_peer_that_restarts_is_followed_again(tmp_path, s3_server, s3_prefix, nodes):
    a = Node(tmp_path, "a", s3_server, s3_prefix)
    b = Node(tmp_path, "b", s3_server, s3_prefix, peers=[a.events], probe=False, prefetch=False)
    nodes.append(a.start())
    nodes.append(b.start())
    first, second = prompt(3), prompt(3)
    with b.client() as cb:
        assert poll(lambda: following(cb))
        with a.client() as ca:
            store(ca, first)
        assert poll(lambda: g4(cb)["blocks"] == 3)
        a.proc.kill9()
        a.proc.start()  # same port: B's SUB reconnects; A's sequence numbers start again at 0
        assert poll(lambda: following(cb, connects=2))
        with a.client() as ca:
            store(ca, second)
        assert poll(lambda: cb.lookup(second).matched == 3)  # probes are off: only A's events tell B
        assert loads_exact(cb, second) == 3
        peer = fleet(cb)["peers"][0]
        assert peer["resets"] + peer["gaps"] >= 1


def test_three_nodes_share_one_bucket(tmp_path, s3_server, s3_prefix, nodes):
    ns = [Node(tmp_path, n, s3_server, s3_prefix, probe=False, prefetch=False) for n in "abc"]
    for n in ns:
        n.cfg["daemon"]["peers"] = [m.events for m in ns if m is not n]
        nodes.append(n.start())
    pa, pb = prompt(2), prompt(2)
    with ns[0].client() as ca, ns[1].client() as cb, ns[2].client() as cc:
        for c in (ca, cb, cc):
            assert poll(lambda c=c: following(c))
        store(ca, pa)
        store(cb, pb)
        for c in (ca, cb, cc):
            assert poll(lambda c=c: c.lookup(pa).matched == 2 and c.lookup(pb).matched == 2)
        assert loads_exact(cc, pa) == 2 and loads_exact(cc, pb) == 2


@needs("curve", zmq.has("curve"), "libzmq without CURVE")
def test_peers_follow_each_other_over_curve(tmp_path, s3_server, s3_prefix, nodes):
    """A fleet sharing one CURVE server key pair with a client allow-list: the event streams are encrypted and
    authenticated, B follows A with its own (listed) keys, and workers use listed key pairs too."""
    from kvbm.security import load_keypair, write_keypair

    pub, sec = (k.decode() for k in zmq.curve_keypair())
    allowed = tmp_path / "clients"
    allowed.mkdir()
    (allowed / "fleet.key").write_text(f'metadata\ncurve\n    public-key = "{pub}"\n')  # the daemons, as peers
    worker_pub, _ = write_keypair(tmp_path / "keys", "worker")
    (allowed / "worker.key").write_text(worker_pub.read_text())
    worker = load_keypair(tmp_path / "keys" / "worker.key_secret")
    keys = {"curve_public_key": pub, "curve_secret_key": sec, "curve_clients_dir": str(allowed)}
    a = Node(tmp_path, "a", s3_server, s3_prefix, **keys)
    b = Node(tmp_path, "b", s3_server, s3_prefix, peers=[a.events], probe=False, prefetch=False, **keys)
    nodes.append(a.start())
    nodes.append(b.start())
    blocks = prompt(2)
    with a.client(keypair=worker) as ca, b.client(keypair=worker) as cb:
        assert poll(lambda: following(cb))
        store(ca, blocks)
        assert poll(lambda: cb.lookup(blocks).matched == 2)
        assert loads_exact(cb, blocks) == 2


def test_follower_counts_gaps_and_resets_and_skips_bad_messages():
    """Sequence numbers of a peer's stream: in order, a jump (lost batches), a restart (back to 0), junk."""
    from kvbm import protocol as p
    from kvbm.fleet.peers import PeerFollower

    applied: list[int] = []
    gaps: list[int] = []
    ctx = zmq.asyncio.Context()
    f = PeerFollower("tcp://127.0.0.1:1", ctx, lambda _f, b: applied.append(len(b.events[0].hashes)),
                     lambda peer: gaps.append(peer.stats.last_seq))
    k = prompt(1)[0]

    def msg(seq: int, n: int = 1) -> list[bytes]:
        ev = p.BlocksStored(namespace=k.namespace, hashes=[k.hash] * n, tier="G4", nbytes=64)
        return [p.EVENTS_TOPIC, seq.to_bytes(8, "big"), p.encode(p.EventBatch(ts=0.0, events=[ev]))]

    f.handle(msg(0))
    f.handle(msg(1, 2))
    assert f.stats.gaps == 0 and gaps == [] and applied == [1, 2]
    f.handle(msg(5))  # 2..4 lost
    assert f.stats.gaps == 1 and f.stats.lost == 3 and gaps == [5]
    f.handle(msg(0, 3))  # the peer restarted
    assert f.stats.resets == 1 and gaps == [5, 0] and applied == [1, 2, 1, 3]
    f.handle([p.EVENTS_TOPIC, (1).to_bytes(8, "big"), b"\xc1junk"])
    f.handle([b"other"])
    assert f.stats.bad == 2 and f.stats.batches == 4 and f.stats.last_seq == 1
    ctx.term()
