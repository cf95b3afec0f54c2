"""Slot budgets under load (issue 37, D13-D15): a load over what a budget has left pins a shorter run instead of
being refused, a store's slots come back to its session once its bytes are in G2 (not after the durable S3
write), and a restarted engine is not charged for its old session's quarantined slots.

Real parts: ``kvbm serve`` in a subprocess (tests/serve_proc.py), real shared memory, SeaweedFS behind the chaos
fault proxy (kvbm.chaos.proxy) to make S3 slow."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc, wait_until

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.chaos.proxy import FaultProxy, FaultRates
from kvbm.client import AsyncWorkerClient
from kvbm.client.lease import Onboarding

SLOT = 64 * 1024
LAYOUT = KVLayout(model="budget", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes


def cfg(tmp: Path, s3: dict | None = None, **daemon) -> dict:
    return {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "2MiB"},
        "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": s3 or {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"metrics_port": 0, "endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", **daemon},
    }


def stop(proxy: FaultProxy) -> None:
    """Stop the proxy once the answers it holds back (3 s) have gone: its loop then closes with none pending."""
    time.sleep(3.5)
    proxy.stop()


def blocks(n: int) -> list[BlockKey]:
    return [BlockKey(LAYOUT.namespace, os.urandom(32)) for _ in range(n)]


def payload(k: BlockKey) -> np.ndarray:
    return np.frombuffer((k.hash * (NB // 32 + 1))[:NB], dtype=np.uint8).copy()


def loaded_right(outs: list[np.ndarray], ks: list[BlockKey]) -> bool:
    return all(np.array_equal(o, payload(k)) for o, k in zip(outs, ks, strict=False))


def test_a_load_over_what_the_budget_has_left_pins_a_shorter_run(tmp_path: Path) -> None:
    """Session budget 4: with 3 slots pinned, a load of 8 held blocks pins the 1 that fits (was: refused
    ``full``); with none pinned, the blocking client asks for the 4 its budget holds, and gets them."""
    d = ServeProc(tmp_path, cfg(tmp_path, max_session_slots=4)).start()
    try:
        ks = blocks(8)
        with d.client() as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks]).stored == 8
            job = Onboarding(c, [k.hash for k in ks[:3]])
            with job.loaded() as got:
                assert got.count == 3
                outs = [np.zeros(NB, np.uint8) for _ in ks]
                assert c.load(ks, outs) == 1 and loaded_right(outs[:1], ks)
            job.released()
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == 4 and loaded_right(outs[:4], ks)
    finally:
        d.stop()


def test_an_onboard_short_of_room_says_the_run_it_holds_and_one_short_of_blocks_does_not(tmp_path: Path) -> None:
    """An 8-slot G2: one session pins 6 blocks, another asks for 4 blocks held on disk and gets the 2 that fit. Its
    reply says 4 are held (``Onboarded.held``): the connector asks again once pins are released, instead of taking a
    short hit and computing the rest (issue 40's long-doc-qa: 512 of 3,968 tokens, TTFT 4.5 s). Short because a
    block is not stored: ``held`` is what was pinned, nothing to wait for. Over the session's budget: the run too."""
    c = cfg(tmp_path, max_session_slots=6)
    c["host"]["capacity"] = 8 * SLOT
    d = ServeProc(tmp_path, c).start()
    try:
        ks, other = blocks(6), blocks(4)
        with d.client() as a, d.client() as b:
            a.register(LAYOUT, worker_id="a")
            b.register(LAYOUT, worker_id="b")
            for run, on_disk in ((other, 4), (ks, 10)):  # each written through before the next needs its slots
                assert a.store(run, [payload(k) for k in run]).stored == len(run)
                assert wait_until(lambda n=on_disk: _disk_blocks(a) == n, timeout=30), "not written to the disk"
        with d.client(admin=True) as admin:
            admin.register(LAYOUT, worker_id="admin")
            admin.evict(namespace=LAYOUT.namespace, tiers=["G2"])  # on the disk only: every Onboard brings them up
        with d.client() as a, d.client() as b:
            a.register(LAYOUT, worker_id="a")
            b.register(LAYOUT, worker_id="b")
            assert a.request(p.Onboard(namespace=a.namespace, hashes=[k.hash for k in ks]), p.Onboarded).count == 6
            got = b.request(p.Onboard(namespace=b.namespace, hashes=[k.hash for k in other]), p.Onboarded)
            assert (got.count, got.held) == (2, 4), got
            assert b.request(p.Release(namespace=b.namespace, hashes=[k.hash for k in other[:2]]), p.Released).count
            lost = b.request(p.Onboard(namespace=b.namespace, hashes=[other[2].hash, os.urandom(32)]), p.Onboarded)
            assert (lost.count, lost.held) == (1, 1), lost
            over = b.request(p.Onboard(namespace=b.namespace, hashes=[k.hash for k in ks + other]), p.Onboarded)
            assert over.held == 10 and over.count <= 6, over
    finally:
        d.stop()


def _disk_blocks(c) -> int:
    return next(t["blocks"] for t in c.stats()["tiers"] if t["tier"] == "G3")


def test_a_restarted_engine_is_not_charged_for_its_old_sessions_quarantined_slots(tmp_path: Path) -> None:
    """Tenant budget 4: an engine pins 4 blocks and restarts (its worker_id registers again, the old session's 4
    slots go to quarantine). The new session loads 4 blocks at once, and reads the right bytes."""
    tenants = [{"name": "t", "token_file": str(tmp_path / "t.token"), "models": ["budget"], "max_slots": 4}]
    d = ServeProc(tmp_path, cfg(tmp_path, tenants=tenants)).start()
    try:
        token = (tmp_path / "t.token").read_text().strip()
        ks = blocks(4)
        old = d.client(tenant_token=token)
        old.register(LAYOUT, worker_id="engine-0")
        assert old.store(ks, [payload(k) for k in ks]).stored == 4
        pinned = Onboarding(old, [k.hash for k in ks]).loaded()
        assert pinned.__enter__().count == 4  # held, never released: the engine died holding them
        with d.client(tenant_token=token) as new:
            new.register(LAYOUT, worker_id="engine-0")
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert new.load(ks, outs) == 4 and loaded_right(outs, ks)
    finally:
        d.stop()


@pytest.mark.s3
def test_a_durable_store_gives_its_slots_back_before_the_s3_write(s3_server, s3_prefix: str, tmp_path: Path) -> None:
    """Session budget 4, S3 answering after 3 s: a durable store of 4 blocks holds the session's 4 slots only
    until its bytes are in G2, so a load of the same session goes ahead while the store's S3 write is pending."""
    proxy = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))).start()
    s3 = {"endpoint": proxy.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
          "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "max_retries": 0,
          "read_timeout_s": 30.0}
    d = ServeProc(tmp_path, cfg(tmp_path, s3, max_session_slots=4)).start()

    async def go() -> tuple[bool, int]:
        ready, later = blocks(4), blocks(4)
        async with AsyncWorkerClient(d.endpoint, timeout_s=30.0) as c:
            await c.register(LAYOUT, worker_id="w")
            assert (await c.store(ready, [payload(k) for k in ready])).stored == 4
            proxy.rates = FaultRates(latency=1.0, latency_s=(3.0, 3.0))
            store = asyncio.ensure_future(c.store(later, [payload(k) for k in later], durable=True))
            await asyncio.sleep(0.5)  # its bytes are copied into G2 by now; its commit waits on S3
            outs = [np.zeros(NB, np.uint8) for _ in ready]
            n = await c.load(ready, outs)
            store_pending = not store.done()
            ack = await store
            assert ack.durable == 4 and n == 4 and loaded_right(outs, ready)
            return store_pending, n

    try:
        store_pending, _ = asyncio.run(go())
        assert store_pending, "the load waited for the durable store's S3 write to end"
    finally:
        d.stop()
        stop(proxy)


@pytest.mark.s3
def test_a_tenants_prefetch_stays_within_its_budget(s3_server, s3_prefix: str, tmp_path: Path) -> None:
    """G2 of 32 slots; tenant a may hold 8, tenant b 24. a's lookup of 16 blocks held only in S3 (answering after
    3 s) starts a prefetch: it may take a's 8 slots, not half of G2, so b's store of its 24 is not refused
    ``full`` meanwhile."""
    proxy = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))).start()
    s3 = {"endpoint": proxy.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
          "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "max_retries": 0,
          "read_timeout_s": 30.0}
    tenants = [{"name": t, "token_file": str(tmp_path / f"{t}.token"), "models": [m], "max_slots": n}
               for t, m, n in (("a", "budget", 8), ("b", "other", 24))]
    d = ServeProc(tmp_path, cfg(tmp_path, s3, tenants=tenants)).start()
    other = KVLayout(model="other", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
    try:
        tok = {t: (tmp_path / f"{t}.token").read_text().strip() for t in "ab"}
        ks = blocks(16)
        theirs = [BlockKey(other.namespace, os.urandom(32)) for _ in range(24)]
        with d.client(tenant_token=tok["a"]) as a, d.client(tenant_token=tok["b"]) as b, d.client(admin=True) as op:
            a.register(LAYOUT, worker_id="a")
            b.register(other, worker_id="b")
            op.register(LAYOUT, worker_id="op")
            for i in range(0, 16, 8):
                assert a.store(ks[i:i + 8], [payload(k) for k in ks[i:i + 8]], durable=True).durable == 8
            op.evict(ks, tiers=["G2", "G3"])
            assert set(a.lookup(ks).tiers) == {"G4"}
            proxy.rates = FaultRates(latency=1.0, latency_s=(3.0, 3.0))
            assert a.lookup(ks).matched == 16  # starts the prefetch, which waits on S3
            ack = b.store(theirs, [payload(k) for k in theirs])
            assert ack.stored == 24
            proxy.heal()
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            n = a.load(ks, outs)
            assert n == 8 and loaded_right(outs[:n], ks)
    finally:
        d.stop()
        stop(proxy)


@pytest.mark.s3
def test_one_tenants_durable_commits_on_a_slow_s3_do_not_shed_another_tenants_stores(
        s3_server, s3_prefix: str, tmp_path: Path) -> None:
    """``max_queue`` 2: tenant a's two durable stores wait on S3 (3 s an answer) with their CommitStores in
    flight; tenant b's store is not shed meanwhile, and a's stores end durable."""
    proxy = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))).start()
    s3 = {"endpoint": proxy.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
          "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "max_retries": 0,
          "read_timeout_s": 30.0}
    tenants = [{"name": t, "token_file": str(tmp_path / f"{t}.token"), "models": [m]}
               for t, m in (("a", "budget"), ("b", "other"))]
    d = ServeProc(tmp_path, cfg(tmp_path, s3, tenants=tenants, max_queue=2)).start()
    other = KVLayout(model="other", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
    tok = {t: (tmp_path / f"{t}.token").read_text().strip() for t in "ab"}

    async def go() -> None:
        ks = blocks(2)
        theirs = [BlockKey(other.namespace, os.urandom(32))]
        async with AsyncWorkerClient(d.endpoint, timeout_s=30.0, tenant_token=tok["a"]) as a:
            await a.register(LAYOUT, worker_id="a")
            proxy.rates = FaultRates(latency=1.0, latency_s=(3.0, 3.0))
            stores = [asyncio.ensure_future(a.store([k], [payload(k)], durable=True)) for k in ks]
            await asyncio.sleep(0.5)  # their CommitStores wait on S3
            with d.client(tenant_token=tok["b"]) as b:
                b.register(other, worker_id="b")
                assert b.store(theirs, [payload(k) for k in theirs]).stored == 1
            assert [ack.durable for ack in await asyncio.gather(*stores)] == [1, 1]

    try:
        asyncio.run(go())
    finally:
        d.stop()
        stop(proxy)


@pytest.mark.s3
def test_a_store_of_blocks_a_failing_prefetch_is_bringing_in_is_kept(s3_server, s3_prefix: str,
                                                                      tmp_path: Path) -> None:
    """G2 + G4 (S3 behind the proxy). 4 blocks the index has in S3 only, whose objects another node purged: a
    lookup starts their prefetch into G2 (S3 answering after 0.5 s, then 404), and meanwhile the worker stores them
    again. The store used to leave each block to the prefetch under way (no slot: "being stored"), which then
    failed: stored 0 of 4, the worker's bytes dropped. It waits for the prefetch (bounded) and takes the slots once
    it failed: stored 4, and a load brings the worker's bytes."""
    from test_durability import _delete_from_bucket

    proxy = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))).start()
    s3 = {"endpoint": proxy.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
          "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "max_retries": 0,
          "read_timeout_s": 30.0}
    d = ServeProc(tmp_path, cfg(tmp_path, s3) | {"disk": {"enabled": False}}).start()
    ks = blocks(4)
    try:
        with d.client(admin=True) as c:
            c.register(LAYOUT, worker_id="w")
            assert c.store(ks, [payload(k) for k in ks], durable=True).durable == 4
            _delete_from_bucket(s3_server, s3_prefix, ks)
            assert c.evict(ks, tiers=["G2"]).removed == 4
            proxy.rates = FaultRates(latency=1.0, latency_s=(0.5, 0.5))
            assert c.lookup(ks).tiers == ["G4"] * 4  # the index's entries: the prefetch starts
            ack = c.store(ks, [payload(k) for k in ks])
            proxy.heal()
            assert ack.stored == 4, f"stored {ack.stored} of 4 (left to the failing prefetch)"
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == 4 and loaded_right(outs, ks)
    finally:
        d.stop()
        proxy.stop()
