"""Fleet bookkeeping that must not lie: a G4 entry another node purged is not a copy (durable stores write it
again, disk eviction demotes again), and a read whose length is not the indexed one is refused, never served.
Real daemons (``kvbm serve`` subprocesses) sharing the conftest's SeaweedFS bucket; purges by the real CLI."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from serve_proc import ServeProc, wait_until

from kvbm.bench.openai_server import free_port as _free_port
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.cli.main import main
from kvbm.client import WorkerClient
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

pytestmark = pytest.mark.s3

LAYOUT = KVLayout(model="fleetdur", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_block=64)
WAIT_S = 30.0  # deadline of the poll loops; never a timing assertion


def free_port() -> int:
    return _free_port()  # not from the kernel's ephemeral range (kvbm.bench.openai_server)


class Node:
    """One daemon: its own G2 pool, disk directory and sockets; the shared bucket and prefix."""

    def __init__(self, tmp: Path, name: str, srv: Any, prefix: str, *, host: str = "1MiB", disk: str | None = None,
                 s3: dict[str, Any] | None = None, **daemon: Any) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.cfg = {
            "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": host, "pin": False},
            "disk": {"enabled": disk is not None, "dir": str(self.dir / "disk"), "capacity": disk or "16MiB",
                     "fsync": False},
            "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
                   "secret_key": srv.secret_key, **(s3 or {})},
            "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
            "daemon": {"endpoint": f"ipc://{self.dir}/d.sock", "events_endpoint": self.events, "metrics_port": 0,
                       "access_log_interval_s": 0, **daemon},
        }
        self.proc: ServeProc | None = None

    def start(self) -> Node:
        self.proc = ServeProc(self.dir, self.cfg).start()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def client(self, *, admin: bool = False) -> WorkerClient:
        assert self.proc is not None
        c = self.proc.client(admin=admin)
        c.register(LAYOUT, worker_id=f"w-{self.dir.name}")
        return c


def prompt(n: int) -> list[BlockKey]:
    return [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(n)]


def payload(k: BlockKey) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(k.hash[:8], "little"))
    return rng.integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


def g4(c: WorkerClient) -> dict:
    return next(t for t in c.stats()["tiers"] if t["tier"] == "G4")


def bucket_tier(srv: Any, prefix: str):
    return make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))


def in_bucket(srv: Any, prefix: str, keys: list[BlockKey]) -> dict[BlockKey, bytes | None]:
    """Each block as a fresh client reads it from the bucket (no daemon's index)."""

    async def go() -> dict[BlockKey, bytes | None]:
        t = bucket_tier(srv, prefix)
        await t.start()
        try:
            out: dict[BlockKey, bytes | None] = {}
            for k in keys:
                buf = bytearray(LAYOUT.block_nbytes)
                n = await t.get_into(k, memoryview(buf))
                out[k] = None if n is None else bytes(buf[:n])
            return out
        finally:
            await t.close()

    return asyncio.run(go())


def purge_direct(node: Node) -> dict:
    """`kvbm purge --direct` of the namespace from the bucket, run with ``node``'s config: no daemon is told."""
    assert node.proc is not None
    res = CliRunner().invoke(main, ["purge", "--all", "--namespace", LAYOUT.namespace, "--from", "bucket", "--direct",
                                    "--yes", "--json"], env={"KVBM_CONFIG": str(node.proc.cfg_path)},
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


# -- item 1: a stale G4 entry is not a copy ---------------------------------------------------------------------
@pytest.mark.parametrize("learned", ["events", "probe"])
def test_durable_store_of_blocks_another_node_purged_really_writes(tmp_path, s3_server, s3_prefix, nodes, learned):
    """A (G2+G4) learns B's blocks from B's events (never seen here) or by its bucket probe (seen, but longer ago
    than s3.copy_max_age_s); B's node purges them from the bucket without telling A. A's CommitStore(durable)
    of those blocks must really write them: an Ack counting them durable with the bucket empty is false."""
    b = Node(tmp_path, "b", s3_server, s3_prefix)
    if learned == "events":
        a = Node(tmp_path, "a", s3_server, s3_prefix, peers=[b.events], probe=False, prefetch=False)
    else:
        a = Node(tmp_path, "a", s3_server, s3_prefix, s3={"copy_max_age_s": 0}, probe_budget_ms=5000,
                 prefetch=False)
    nodes.append(a.start())
    nodes.append(b.start())
    keys = prompt(4)
    with a.client() as ca, b.client() as cb:
        if learned == "events":
            assert wait_until(lambda: all(p["connected"] for p in ca.stats()["daemon"]["fleet"]["peers"]), WAIT_S)
        assert cb.store(keys, [payload(k) for k in keys], durable=True).durable == 4
        if learned == "events":
            assert wait_until(lambda: g4(ca)["blocks"] == 4, WAIT_S)
        else:
            assert ca.lookup(keys).matched == 4
        assert ca.lookup(keys).tiers == ["G4"] * 4
        assert purge_direct(b)["deleted"] == 4
        assert set(in_bucket(s3_server, s3_prefix, keys).values()) == {None}

        ack = ca.store(keys, [payload(k) for k in keys], durable=True)
        assert ack.stored == 4 and ack.durable == 4
        got = in_bucket(s3_server, s3_prefix, keys)
        assert all(got[k] == payload(k).tobytes() for k in keys), "acked durable, but not in the bucket"
        st = g4(ca)["stats"]
        assert st["reconfirms"] >= 4 and st["stale"] == 4


def test_a_bucket_rescan_drops_what_another_node_purged_from_the_index(tmp_path, s3_server, s3_prefix, nodes):
    """A indexed B's blocks; B's node purges them without telling A; an admin Reindex of G4 on A (a rescan) must
    drop them from A's index, not only from its S3 tier's own: a lookup no longer finds them."""
    a = Node(tmp_path, "a", s3_server, s3_prefix, probe=False, prefetch=False)
    b = Node(tmp_path, "b", s3_server, s3_prefix)
    nodes.append(a.start())
    nodes.append(b.start())
    keys = prompt(3)
    from kvbm import protocol as p

    with a.client(admin=True) as ca, b.client() as cb:
        assert cb.store(keys, [payload(k) for k in keys], durable=True).durable == 3
        ca.request(p.Reindex(namespace=LAYOUT.namespace, tiers=["G4"]), p.Reindexed, timeout_s=60)
        assert ca.lookup(keys).matched == 3
        assert purge_direct(b)["deleted"] == 3
        got = ca.request(p.Reindex(namespace=LAYOUT.namespace, tiers=["G4"]), p.Reindexed, timeout_s=60)
        assert got.blocks == 0
        assert ca.lookup(keys).matched == 0 and g4(ca)["blocks"] == 0


def test_disk_eviction_keeps_its_only_copy_when_another_node_purged_s3(tmp_path, s3_server, s3_prefix, nodes):
    """A (G2 of 4 slots, G3 of 4 blocks of 16 KiB + header, G4) stores blocks durably; B's node purges them from
    the bucket. When A's disk must make room it may not drop them believing S3 holds them: it demotes them to S3
    again first."""
    a = Node(tmp_path, "a", s3_server, s3_prefix, host="256KiB", disk="80KiB", s3={"copy_max_age_s": 0},
             probe=False, prefetch=False)
    b = Node(tmp_path, "b", s3_server, s3_prefix)
    nodes.append(a.start())
    nodes.append(b.start())
    first, more = prompt(4), prompt(8)
    with a.client() as ca:
        assert ca.store(first, [payload(k) for k in first], durable=True).durable == 4
        assert purge_direct(b)["deleted"] == 4
        for i in range(0, len(more), 2):  # the disk evicts ``first`` (least recently used) to make room
            ca.store(more[i : i + 2], [payload(k) for k in more[i : i + 2]], durable=True)
        st = ca.stats()
        disk = next(t for t in st["tiers"] if t["tier"] == "G3")
        assert disk["stats"]["deletes"] >= 4, json.dumps(disk)  # the disk did evict them ...
    got = in_bucket(s3_server, s3_prefix, first)
    assert all(got[k] == payload(k).tobytes() for k in first), "evicted from disk, but not in the bucket"  # ... to S3


# -- item 5: the length read is the length committed ---------------------------------------------------------
def test_a_shorter_valid_object_is_refused_never_served_with_a_stale_tail(tmp_path, s3_server, s3_prefix, nodes):
    """A (G2+G4) indexed two blocks at their full length; one object is then overwritten in the bucket by a valid
    block of half the length (another writer). Onboarding it into a G2 slot sized by the index must refuse it (a
    miss, counted) rather than commit the slot with a stale tail; the block before it is served exactly."""
    a = Node(tmp_path, "a", s3_server, s3_prefix, probe=False, prefetch=False)
    nodes.append(a.start())
    keys = prompt(2)
    with a.client(admin=True) as ca:
        assert ca.store(keys, [payload(k) for k in keys], durable=True).durable == 2
        assert ca.evict(keys, tiers=["G2"]).removed == 2
        assert ca.lookup(keys).tiers == ["G4", "G4"]
        short = np.full(LAYOUT.block_nbytes // 2, 7, np.uint8)

        async def overwrite() -> None:
            t = bucket_tier(s3_server, s3_prefix)
            await t.start()
            try:
                await t.put(keys[1], memoryview(short))
            finally:
                await t.close()

        asyncio.run(overwrite())
        outs = [np.zeros(LAYOUT.block_nbytes, np.uint8) for _ in keys]
        n = ca.load(keys, outs)
        for k, o in zip(keys[:n], outs[:n], strict=True):
            assert np.array_equal(o, payload(k)), f"wrong bytes served for {k}"
        assert n == 1
        st = g4(ca)["stats"]
        assert st["short_reads"] == 1 and st["corrupt"] == 0
        assert ca.lookup(keys).matched == 1  # forgotten: the next request recomputes and stores it again


# -- item 3: a purge is reflected in the daemon in batches ---------------------------------------------------
def test_a_purge_through_the_daemon_is_forgotten_without_a_request_per_block(tmp_path, s3_server, s3_prefix, nodes):
    """1,200 blocks in the bucket, indexed by a daemon. `kvbm purge` deletes them (DeleteObjects) and tells the
    daemon, which drops them from its index without asking S3 again (no HEAD, no DELETE per block); an admin Evict
    of blocks still in the bucket deletes them in DeleteObjects batches, not one request each."""
    n = 1200
    keys = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(n)]

    async def seed() -> None:
        t = bucket_tier(s3_server, s3_prefix)
        await t.start()
        try:
            for i in range(0, n, 50):  # within s3.max_pending_writes
                await asyncio.gather(*(t.put(k, k.hash * 64) for k in keys[i : i + 50]))
        finally:
            await t.close()

    asyncio.run(seed())
    a = Node(tmp_path, "a", s3_server, s3_prefix, probe=False, prefetch=False, index_bucket="start")
    nodes.append(a.start())
    with a.client(admin=True) as ca:
        assert g4(ca)["blocks"] == n
        # An admin Evict of the last 200: deleted from the bucket in one DeleteObjects, no HEAD.
        assert ca.evict(keys[-200:], tiers=["G4"]).removed == 200
        st = g4(ca)["stats"]
        assert st["delete_requests"] == 1 and st["heads"] == 0, st
        assert set(in_bucket(s3_server, s3_prefix, keys[-3:]).values()) == {None}
        # The purge of the rest, through the daemon.
        res = CliRunner().invoke(main, ["purge", "--all", "--namespace", LAYOUT.namespace, "--from", "bucket",
                                        "--yes", "--json"], env={"KVBM_CONFIG": str(a.proc.cfg_path)},
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["deleted"] == n - 200 and f"dropped {n - 200} index entries" in out["daemon"], out
        st = g4(ca)
        assert st["blocks"] == 0
        assert st["stats"]["delete_requests"] == 1 and st["stats"]["deletes"] == 200, st["stats"]  # none for the purge
        assert ca.lookup(keys[:4]).matched == 0


# -- item 4: access logs are decoded, merged and encoded off the event loop ----------------------------------
def test_access_log_compaction_reading_and_prewarm_ranking_run_off_the_event_loop(s3_server, s3_prefix,
                                                                                    monkeypatch):
    """A daemon's access logs can hold millions of lines: writing one, compacting them, merging them for purge or
    prewarm and ranking a namespace for join-warm must not run on the event loop (its requests would stall). The
    real recorder against SeaweedFS compacts three logs, reads them back and ranks a prewarm; every encode,
    decode and sort is seen on a worker thread."""
    import kvbm.fleet.recency as recency
    import kvbm.ops.prewarm as prewarm
    from kvbm.manager.core import BlockManager
    from kvbm.tiers.host import HostTier

    seen: list[tuple[str, bool]] = []

    def spy(name: str, fn):
        def wrapped(*a, **kw):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            seen.append((name, on_loop))
            return fn(*a, **kw)
        return wrapped

    for name in ("encode_log", "encode_merged", "decode_entries"):
        monkeypatch.setattr(recency, name, spy(name, getattr(recency, name)))
    monkeypatch.setattr(prewarm, "rank_hottest", spy("rank_hottest", prewarm.rank_hottest))
    keys = prompt(3)
    now = [1_000_000.0]

    async def go() -> None:
        tier = bucket_tier(s3_server, s3_prefix)
        mgr = BlockManager([HostTier(8 * LAYOUT.block_nbytes, LAYOUT.block_nbytes), tier])
        await mgr.start(index=False)
        try:
            for k in keys:
                await tier.put(k, payload(k).tobytes())
            rec = recency.AccessRecorder(tier, "node-a", 1, clock=lambda: now[0], compact_at=3)
            for k in keys:  # three logs, one hit each: the third flush compacts them into one
                rec.record([k])
                assert await rec.flush() == 1
                now[0] += 10
            assert rec.compacted == 2
            times, logs = await recency.read_access_times(tier, [LAYOUT.namespace])
            assert len(logs) == 1 and set(times) == set(keys)
            res = await prewarm.prewarm_manager(mgr, tier, [LAYOUT.namespace], 2, "G2")
            assert res["prewarmed"] == 2
        finally:
            await mgr.close()

    asyncio.run(go())
    assert {n for n, _ in seen} == {"encode_log", "encode_merged", "decode_entries", "rank_hottest"}, seen
    assert [n for n, on_loop in seen if on_loop] == [], seen
