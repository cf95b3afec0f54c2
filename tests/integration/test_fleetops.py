"""Fleet-wide recency (access logs in the bucket), LRU purge, ``prewarm --hottest``, parallel listing and
``kvbm bench fleet``: against the real SeaweedFS of the conftest and a real daemon subprocess."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time

import numpy as np
import pytest
from serve_proc import ServeProc
from test_cli import cli_env, data_for, put_s3, run, tier_for
from test_ops import get

import kvbm.tiers.s3.fastlist as s3fastlist
import kvbm.tiers.s3.listing as s3listing
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.fleet.recency import AccessRecorder, access_prefix, read_access_times

pytestmark = pytest.mark.s3

NS = "tiny-llama-0123456789abcdef"
NS2 = "other-model-00112233aabbccdd"
PAYLOAD = 3000


def bkey(ns: str, i: int) -> BlockKey:
    return BlockKey(ns, hashlib.blake2b(i.to_bytes(4, "big"), digest_size=16).digest())  # spread over shards


async def _raw_keys(srv, prefix: str) -> list[str]:
    t = tier_for(srv, prefix)
    await t.start()
    try:
        return [k async for _b, k, _s, _m in t.list_objects()]
    finally:
        await t.close()


# -- the daemon records hits; purge --max-bytes evicts least recently used -----------------------------------
LAYOUT = KVLayout(model="tiny-llama", num_layers=2, num_kv_heads=2, head_size=8, dtype="float16",
                  tokens_per_block=4, block_bytes=4096)


def test_purge_max_bytes_keeps_recently_hit_blocks(s3_server, s3_prefix, tmp_path):
    """Blocks written first but hit since (through a real daemon) survive a budget purge; the cold blocks
    written later go. By write time alone the hot ones, being the oldest, would be deleted."""
    d = ServeProc(tmp_path, {
        "block_bytes": LAYOUT.block_bytes, "device": {"enabled": False},
        "host": {"capacity": "1MiB", "pin": False}, "disk": {"enabled": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0,
                   "access_log_interval_s": 1, "node_id": "node-a"},
    }).start()
    ns = LAYOUT.namespace
    keys = [BlockKey(ns, i.to_bytes(4, "big").ljust(16, b"\x09")) for i in range(6)]
    bufs = [np.full(LAYOUT.block_bytes, i, np.uint8) for i in range(6)]
    try:
        with d.client() as c:
            c.register(LAYOUT)
            c.store(keys[:3], bufs[:3], durable=True)
            time.sleep(1.2)  # LastModified has one-second resolution: the hot three are strictly older
            c.store(keys[3:], bufs[3:], durable=True)
            outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(3)]
            assert c.load(keys[:3], outs) == 3
        deadline = time.monotonic() + 30
        logs = []
        while time.monotonic() < deadline and not logs:
            logs = [k for k in asyncio.run(_raw_keys(s3_server, s3_prefix)) if "/_access/" in k]
            time.sleep(0.2)
        assert logs and all(f"/_access/{ns}/node-a/" in k for k in logs), logs
    finally:
        d.stop()
    env = cli_env(s3_server, s3_prefix, tmp_path)
    obj = LAYOUT.block_bytes + 128
    out = json.loads(run(env, "purge", "--max-bytes", str(3 * obj), "--from", "bucket", "--yes", "--json").output)
    assert out["deleted"] == 3 and out["by"] == "access", out
    left = {k.rsplit("/", 1)[-1] for k in asyncio.run(_raw_keys(s3_server, s3_prefix)) if "/_access/" not in k}
    assert left == {k.hash.hex() for k in keys[:3]}


def test_access_logs_are_neither_blocks_nor_foreign_and_old_ones_are_purged(s3_server, s3_prefix, tmp_path):
    keys = [bkey(NS, i) for i in range(4)]
    asyncio.run(put_s3(s3_server, s3_prefix, keys))

    async def logs() -> None:
        t = tier_for(s3_server, s3_prefix)
        await t.start()
        try:
            now = time.time()
            for age, k in ((40 * 86400, keys[0]), (3600, keys[1])):
                rec = AccessRecorder(t, "n1", 60, clock=lambda a=age: now - a)
                rec.record([k])
                assert await rec.flush() == 1
        finally:
            await t.close()

    asyncio.run(logs())
    env = cli_env(s3_server, s3_prefix, tmp_path)
    st = json.loads(run(env, "status", "--direct", "--json").output)
    assert st["bucket"]["foreign_objects"] == 0, st["bucket"]
    assert st["bucket"]["namespaces"][NS]["objects"] == 4
    out = json.loads(run(env, "purge", "--older-than", "30d", "--from", "bucket", "--yes", "--json").output)
    assert out["deleted"] == 0 and out["access_logs_deleted"] == 1, out
    left = [k for k in asyncio.run(_raw_keys(s3_server, s3_prefix)) if "/_access/" in k]
    assert len(left) == 1 and left[0].startswith(access_prefix(s3_prefix, NS) + "n1/")


def test_a_nodes_access_logs_are_compacted_and_keep_every_last_access(s3_server, s3_prefix):
    """A daemon flushing every interval leaves at most ``compact_at`` logs per namespace: older ones are merged
    into its newest (per-line access times), and the merged view is the same as before. Another node's logs
    are never touched; a hit older than the recorder's horizon is dropped from the merged log."""

    async def go() -> None:
        t = tier_for(s3_server, s3_prefix)
        await t.start()
        try:
            now = [time.time() - 10_000]
            other = AccessRecorder(t, "n2", 60, clock=lambda: now[0])
            other.record([bkey(NS, 999)])
            assert await other.flush() == 1
            rec = AccessRecorder(t, "n1", 60, clock=lambda: now[0], compact_at=8, keep_s=5000)
            rec.record([bkey(NS, 1000)])  # hit at t0: beyond the horizon by the end
            await rec.flush()
            now[0] += 10_000  # that hit is now past the 5,000 s horizon; every hit below stays within it
            expect: dict[BlockKey, float] = {}
            for i in range(30):
                now[0] += 100
                rec.record([bkey(NS, i), bkey(NS, i % 3)])
                rec.record([bkey(NS2, i)])
                await rec.flush()
                for k in (bkey(NS, i), bkey(NS, i % 3), bkey(NS2, i)):
                    expect[k] = float(math.ceil(now[0]))
            keys = [k async for _b, k, _s, _m in t.list_objects(key_prefix="_access/")]
            mine = [k for k in keys if "/n1/" in k]
            for ns in (NS, NS2):
                n = sum(1 for k in mine if k.startswith(access_prefix(s3_prefix, ns)))
                assert 1 <= n <= 8, (ns, n, mine)
            assert sum(1 for k in keys if "/n2/" in k) == 1
            assert rec.describe()["logs_compacted"] > 0
            times, _logs = await read_access_times(t, [NS, NS2])
            assert bkey(NS, 999) in times  # the other node's hit
            assert bkey(NS, 1000) not in times  # older than the horizon
            for k, e in expect.items():
                assert times.get(k) == e, (k, times.get(k), e)
        finally:
            await t.close()

    asyncio.run(go())


# -- prewarm --hottest -------------------------------------------------------------------------------------
def test_prewarm_hottest_brings_the_most_recently_used_into_disk(s3_server, s3_prefix, tmp_path):
    keys = [bkey(NS, i) for i in range(8)]
    asyncio.run(put_s3(s3_server, s3_prefix, keys))

    async def hits() -> dict:
        t = tier_for(s3_server, s3_prefix)
        await t.start()
        try:
            now = time.time()
            # Hits after the writes (blocks without a recorded hit rank by their write time).
            for node, later, picked in (("a", 100, [keys[6], keys[0]]), ("b", 200, [keys[0], keys[4]]),
                                        ("a", 300, [keys[2]])):
                rec = AccessRecorder(t, node, 60, clock=lambda a=later: now + a)
                rec.record(picked)
                await rec.flush()
            return (await read_access_times(t, [NS]))[0]
        finally:
            await t.close()

    times = asyncio.run(hits())
    assert times[keys[2]] > times[keys[0]] == times[keys[4]] > times[keys[6]]  # merged across nodes: the latest
    env = cli_env(s3_server, s3_prefix, tmp_path)
    out = json.loads(run(env, "prewarm", "--namespace", NS, "--hottest", "3", "--json").output)
    assert out["fetched"] == 3, out
    on_disk = {p.stem for p in (tmp_path / "disk" / NS).rglob("*.kvb")}
    assert on_disk == {keys[i].hash.hex() for i in (2, 0, 4)}
    for i in (2, 0, 4):
        k = keys[i]
        raw = (tmp_path / "disk" / NS / k.hash.hex()[:2] / f"{k.hash.hex()}.kvb").read_bytes()
        assert raw.endswith(data_for(k))


# -- parallel listing --------------------------------------------------------------------------------------
def test_parallel_listing_returns_exactly_the_serial_set_and_indexes_by_shard(s3_server, s3_prefix, monkeypatch):
    # Small pages, so 300 blocks take the same path as a million: a few serial pages, then by shard.
    monkeypatch.setattr(s3listing, "LIST_PAGE", 20)
    monkeypatch.setattr(s3listing, "LIST_SERIAL_PAGES", 2)
    keys = [bkey(NS, i) for i in range(300)] + [bkey(NS2, i) for i in range(40)]
    foreign = [f"{s3_prefix}/README", f"{s3_prefix}/{NS}/stray", f"{s3_prefix}/{NS}/zz/x",
               f"{s3_prefix}/not-a-ns/ab/cd", f"{s3_prefix}/{NS2}/ab", f"{s3_prefix}/{NS}/a&b",
               f"{s3_prefix}/{NS}/p%25 q+r<"]
    for i in range(0, len(keys), 50):
        asyncio.run(put_s3(s3_server, s3_prefix, keys[i : i + 50], n=16, foreign=foreign if not i else ()))

    async def go() -> tuple[list, list, list, list[str]]:
        t = tier_for(s3_server, s3_prefix)
        await t.start()
        prefixes: list[str] = []
        t.session.client.meta.events.register("provide-client-params.s3.ListObjectsV2",
                                   lambda params, **_: prefixes.append(params["Prefix"]))
        try:
            rec = AccessRecorder(t, "n1", 60)
            rec.record(keys[:2])
            await rec.flush()
            full = [e async for e in t.list_objects()]
            serial = [(b, k, s) for b, k, s, _m in full]
            t.session.client.meta.events.unregister("before-parse.s3.ListObjectsV2", s3fastlist.fast_list_contents)
            assert [e async for e in t.list_objects()] == full  # the fast page parser agrees with botocore's
            t.session.client.meta.events.register("before-parse.s3.ListObjectsV2", s3fastlist.fast_list_contents)
            par = [(b, k, s) async for b, k, s, _m in t.list_objects_parallel(concurrency=4)]
            one_ns = [(b, k, s) async for b, k, s, _m in t.list_objects_parallel(NS)]
            prefixes.clear()
            indexed = [sb.key async for sb in t.scan(NS)]
            return serial, par, one_ns, indexed, prefixes
        finally:
            await t.close()

    serial, par, one_ns, indexed, prefixes = asyncio.run(go())
    assert len(serial) == len(keys) + len(foreign) + 1  # + the access log
    assert sorted(par, key=lambda x: x[1]) == serial and len(set(par)) == len(par)
    assert sorted(one_ns, key=lambda x: x[1]) == [x for x in serial if x[1].startswith(f"{s3_prefix}/{NS}/")]
    assert set(indexed) == {k for k in keys if k.namespace == NS}
    # The daemon's re-index (scan) lists most shard directories on their own, after a few serial pages.
    shards = {k.hash.hex()[:2] for k in keys if k.namespace == NS}
    listed = {p for p in prefixes if p.startswith(f"{s3_prefix}/{NS}/") and p.count("/") == 3}
    assert len(shards) > 100 and len(listed) > len(shards) // 2
    assert listed <= {f"{s3_prefix}/{NS}/{h}/" for h in shards} | {f"{s3_prefix}/{NS}/zz/"}


# -- a daemon joins warm -----------------------------------------------------------------------------------
def test_serve_with_prewarm_hottest_is_ready_once_the_hottest_blocks_are_on_disk(s3_server, s3_prefix, tmp_path):
    keys = [bkey(NS, i) for i in range(6)]
    asyncio.run(put_s3(s3_server, s3_prefix, keys))

    async def hits() -> None:
        t = tier_for(s3_server, s3_prefix)
        await t.start()
        try:
            rec = AccessRecorder(t, "old-node", 60, clock=lambda: time.time() + 100)
            rec.record([keys[3], keys[1]])
            await rec.flush()
        finally:
            await t.close()

    asyncio.run(hits())
    d = ServeProc(tmp_path, {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "1MiB", "fsync": False, "o_direct": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": -1,
                   "prewarm_hottest": 2},
    }).start(marks=("daemon.started", "prewarm.done"))
    try:
        code, body = get(d.info["metrics_port"], "/readyz")
        assert code == 200 and json.loads(body)["checks"]["prewarmed"] is True, body
        on_disk = {p.stem for p in (tmp_path / "disk" / NS).rglob("*.kvb")}
        assert on_disk == {keys[3].hash.hex(), keys[1].hash.hex()}
        with d.client() as c:
            st = c.stats()
        assert st["daemon"]["prewarm"] == "done"
    finally:
        d.stop()


def test_plan_purge_ranks_by_last_use_and_falls_back_to_write_time():
    from kvbm.fleet.recency import AccessLog
    from kvbm.ops import Entry, Selector, plan_log_purge, plan_purge, rank_hottest, with_access

    now = 10_000.0
    es = [Entry("bucket", bkey(NS, i), f"k{i}", 100, now - 1000 * (5 - i)) for i in range(5)]  # k0 oldest write
    es = with_access(es, {es[0].key: now - 10, es[1].key: now - 4500})  # k0 hot; k1's hit is older than its write
    assert [e.ref for e in plan_purge(es, Selector(max_bytes=300), now)] == ["k1", "k2"]
    assert [e.ref for e in plan_purge(es, Selector(older_than_s=2500), now)] == ["k1", "k2"]
    assert [e.ref for e in plan_purge(es, Selector(max_bytes=300), now)] != [e.ref for e in plan_purge(
        [Entry(e.store, e.key, e.ref, e.size, e.mtime) for e in es], Selector(max_bytes=300), now)]
    assert [e.ref for e in rank_hottest(es, 2)] == ["k0", "k4"]
    assert [e.ref for e in rank_hottest(es, max_bytes=250)] == ["k0", "k4"]
    logs = [AccessLog("a", NS, "n", int(now - 40 * 86400)), AccessLog("b", NS, "n", int(now - 60)),
            AccessLog("c", NS2, "n", int(now - 40 * 86400))]
    assert [lg.key for lg in plan_log_purge(logs, Selector(older_than_s=1), 30 * 86400, now)] == ["a", "c"]
    assert [lg.key for lg in plan_log_purge(logs, Selector(namespaces=(NS,), all=True), 30 * 86400, now)] == ["a", "b"]
