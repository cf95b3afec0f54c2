"""The daemon in a subprocess, over real sockets: round trips through G2 shared memory, concurrency,
fuzzing, backpressure, leases, kill -9 recovery, metrics and the vLLM KV-event view."""

import asyncio
import contextlib
import glob
import os
import random
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
from needs import needs
from serve_proc import ServeProc, wait_until

from kvbm import protocol as p
from kvbm.bench.openai_server import free_port
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import AsyncWorkerClient, DaemonError, DaemonUnavailable, Overloaded, WorkerClient

SLOT = 64 * 1024
LAYOUT = KVLayout(model="tiny", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes


def keys(n, tag=b"", ns=LAYOUT.namespace):
    return [BlockKey(ns, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def payload(key):
    rng = np.random.default_rng(int.from_bytes(key.hash[:8], "big") ^ len(key.hash))
    return rng.integers(0, 256, NB, dtype=np.uint8)


class DaemonProc(ServeProc):
    """A G2+G3 daemon in ``tmp``; restartable on the same disk dir."""

    def __init__(self, tmp, *, host="4MiB", fsync=False, disk=True, **daemon):
        d = {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock", "metrics_port": -1,
             "max_message_bytes": 256 * 1024, **daemon}
        super().__init__(tmp, {
            "block_bytes": SLOT,
            "device": {"enabled": False},
            "host": {"capacity": host},
            "disk": {"dir": str(tmp / "disk"), "capacity": "256MiB", "fsync": fsync, "o_direct": False}
            if disk else {"enabled": False},
            "s3": {"enabled": False},
            "embedded_s3": {"enabled": False},
            "transfer": {"backend": "plain"},
            "daemon": d,
        })


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("kvbmd"), host="8MiB").start()
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.log_path.read_text()[-3000:]


def test_register_lookup_store_load_round_trip_is_byte_exact(daemon):
    with daemon.client(admin=True) as c:  # it evicts too: the admin token from the daemon's token file
        reg = c.register(LAYOUT, worker_id="rt")
        assert reg.namespace == LAYOUT.namespace and reg.slot_bytes == SLOT and reg.shm_name
        ks = keys(6, b"rt")
        data = [payload(k) for k in ks]
        assert c.lookup(ks).matched == 0
        ack = c.store(ks[:4], data[:4], durable=True)
        assert (ack.stored, ack.durable) == (4, 4)
        # Storing again is a no-op in G2 (slots come back None) but still durable.
        assert c.store(ks[:4], data[:4], durable=True).stored == 0
        look = c.lookup(ks)
        assert look.matched == 4 and look.tiers == ["G2"] * 4
        outs = [np.zeros(NB, np.uint8) for _ in ks]
        assert c.load(ks, outs) == 4  # the leading held run only
        for i in range(4):
            assert np.array_equal(outs[i], data[i])
        assert not outs[4].any()
        # Torch tensors and bytes work as sources and sinks too.
        import torch

        t_out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(2)]
        assert c.store(ks[4:6], [torch.from_numpy(data[4]), data[5].tobytes()]).stored == 2
        assert c.load(ks[4:6], t_out) == 2
        assert bytes(t_out[0].numpy()) == data[4].tobytes() and bytes(t_out[1].numpy()) == data[5].tobytes()
        st = c.stats()
        assert st["daemon"]["pins"] == 0  # load released its pins
        assert {t["tier"] for t in st["tiers"]} == {"G2", "G3"}
        # Evict from G2 only: lookups now find the blocks on disk, and load brings them back.
        ev = c.evict(ks[:2], tiers=["G2"])
        assert ev.removed == 2
        assert c.lookup(ks[:2]).tiers == ["G3", "G3"]
        # That lookup started a prefetch: the blocks come back up to G2 without an Onboard.
        deadline = time.monotonic() + 10
        while c.lookup(ks[:2]).tiers != ["G2", "G2"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.lookup(ks[:2]).tiers == ["G2", "G2"] and c.stats()["daemon"]["prefetch_blocks"] >= 2
        outs = [np.zeros(NB, np.uint8) for _ in range(2)]
        assert c.load(ks[:2], outs) == 2 and np.array_equal(outs[1], data[1])


def test_errors_are_typed(daemon):
    with daemon.client() as c:
        with pytest.raises(DaemonError) as ei:
            c.lookup(keys(1))  # not registered yet
        assert ei.value.code == p.E_UNREGISTERED
        c.register(LAYOUT, worker_id="errs")
        with pytest.raises(DaemonError) as ei:
            c.store(keys(1, b"x", ns="other-0123456789abcdef"), [payload(keys(1)[0])])
        assert ei.value.code == p.E_FORBIDDEN  # a token serves its own namespace only
        with pytest.raises(DaemonError) as ei:
            c.evict(keys(1), tiers=["G2"])
        assert ei.value.code == p.E_FORBIDDEN  # evicting needs the admin token
    with daemon.client(admin=True) as c:
        c.register(LAYOUT, worker_id="errs-admin")
        with pytest.raises(DaemonError) as ei:
            c.evict(keys(1), tiers=["G9"])
        assert ei.value.code == p.E_BAD_REQUEST
        big = KVLayout(model="big", num_layers=8, num_kv_heads=8, head_size=128, block_bytes=8 << 20)
        with pytest.raises(DaemonError):
            WorkerClient(daemon.endpoint, timeout_s=5).register(big)  # blocks larger than a G2 slot
        # A barrier that not every rank reaches times out with complete=False.
        rep = c.barrier("engine", step="lonely", rank=0, world_size=2, timeout_s=0.3)
        assert not rep.complete and rep.arrived == 1
    with pytest.raises(DaemonUnavailable):
        WorkerClient(f"ipc://{daemon.tmp}/nobody.sock", timeout_s=0.3).register(LAYOUT)


@needs("curve", zmq.has("curve"), "libzmq without CURVE")
def test_curve_encryption_requires_the_server_key(tmp_path):
    pub, sec = zmq.curve_keypair()
    d = DaemonProc(tmp_path, curve_public_key=pub.decode(), curve_secret_key=sec.decode(),
                   curve_allow_any_client=True).start()  # encryption only (allow-list: test_security.py)
    try:
        with WorkerClient(d.endpoint, timeout_s=5, curve_server_key=pub.decode()) as c:
            c.register(LAYOUT, worker_id="curve")
            assert c.lookup(keys(1)).matched == 0
        with pytest.raises(DaemonUnavailable):  # plain-text clients get no answer
            WorkerClient(d.endpoint, timeout_s=0.5).register(LAYOUT)
    finally:
        d.stop()


def test_eight_workers_concurrently(daemon):
    errors = []
    shared = keys(4, b"shared")

    def worker(i):
        try:
            with daemon.client() as c:
                c.register(LAYOUT, worker_id=f"w{i}", engine_id="e8", tp_rank=i, tp_size=8)
                mine = shared + keys(12, b"w%d" % i)
                data = [payload(k) for k in mine]
                for lo in range(0, len(mine), 4):
                    ack = c.store(mine[lo:lo + 4], data[lo:lo + 4], durable=lo == 0)
                    assert ack.stored <= 4
                assert c.barrier("e8", step=1, rank=i, timeout_s=20).complete
                assert c.lookup(mine).matched == len(mine)
                outs = [np.zeros(NB, np.uint8) for _ in mine]
                assert c.load(mine, outs) == len(mine)
                for o, d in zip(outs, data, strict=True):
                    assert np.array_equal(o, d)
        except BaseException as e:
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with daemon.client() as c:
        c.register(LAYOUT, worker_id="check")
        st = c.stats()
        assert st["daemon"]["pins"] == 0
        assert c.lookup(shared).matched == 4


def test_fuzzed_frames_never_kill_the_daemon(daemon):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    rng = random.Random(1234)
    good = p.encode(p.Ping(rid=1, token="nobody"))
    reg = p.encode(p.Register(rid=2, worker_id="fz", engine_id="e", layout=LAYOUT))
    frames = [[bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))] for _ in range(100)]
    frames += [[good[:n]] for n in range(len(good))]  # every truncation
    frames += [[reg[:n]] for n in range(0, len(reg), 7)]
    frames += [
        [msgspec.msgpack.encode({"type": "Ping", "v": 99, "rid": 5})],
        [msgspec.msgpack.encode({"type": "Explode", "v": p.PROTOCOL_VERSION, "rid": 6})],
        [msgspec.msgpack.encode({"type": "Lookup", "v": p.PROTOCOL_VERSION, "rid": 7, "namespace": "n",
                                 "hashes": "nope"})],
        [b"\x00" * (256 * 1024 + 1)],  # oversized
        [good, good, good],  # wrong frame count: dropped
        [b"", b"", good],
        [p.encode(p.Pong(rid=8))],  # a reply sent as a request
        [good],  # well formed, but from a worker that never registered
    ]
    for f in frames:
        s.send_multipart(f)
    replies = 0
    while s.poll(1000):
        reply = p.decode_reply(s.recv_multipart()[-1])
        assert isinstance(reply, p.Error)
        replies += 1
    assert replies >= 100
    s.close(0)
    assert daemon.proc.poll() is None
    with daemon.client() as c:
        c.register(LAYOUT, worker_id="after-fuzz")
        c.ping()
        st = c.stats()["daemon"]
        for code in (p.E_MALFORMED, p.E_VERSION, p.E_UNKNOWN_TYPE, p.E_TOO_LARGE, p.E_UNREGISTERED):
            assert st["errors"].get(code, 0) >= 1, (code, st["errors"])
        assert st["dropped"] >= 1


def test_metrics_endpoint_and_block_events(daemon):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
    sub.connect(daemon.info["events"])
    time.sleep(0.3)  # PUB/SUB slow joiner
    with daemon.client() as c:
        c.register(LAYOUT, worker_id="ev")
        ks = keys(2, b"ev")
        c.store(ks, [payload(k) for k in ks])
        # Every tier change is published: the store into G2, then the write-through cascade below it.
        seen: dict[str, set[bytes]] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {"G2", "G3"} <= {t for t, h in seen.items() if len(h) == 2}:
            if not sub.poll(1000):
                continue
            topic, seq, body = sub.recv_multipart()
            assert topic == b"kvbm" and len(seq) == 8
            for ev in p.decode_events(body).events:
                if isinstance(ev, p.BlocksStored):
                    seen.setdefault(ev.tier, set()).update(ev.hashes)
        assert seen["G2"] == {k.hash for k in ks} and seen["G3"] == {k.hash for k in ks}
    sub.close(0)
    port = daemon.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'kvbm_tier_blocks{tier="G2"}' in text and "kvbm_daemon_shed_total" in text
    assert "kvbm_tier_corrupt_total" in text and "kvbm_daemon_queue_depth" in text


def test_offloads_are_shed_under_load_while_lookups_answer(tmp_path):
    d = DaemonProc(tmp_path, host="8MiB", fsync=True, max_queue=2).start()
    try:
        async def go():
            c = AsyncWorkerClient(d.endpoint, timeout_s=20)
            await c.register(LAYOUT, worker_id="load")
            batches = [keys(2, b"L%d" % i) for i in range(40)]
            data = [[payload(k) for k in b] for b in batches]
            stores = [asyncio.ensure_future(c.store(b, x, durable=True)) for b, x in zip(batches, data, strict=True)]
            look = await c.lookup(keys(3, b"nothing"))  # answered within the client's deadline
            results = await asyncio.gather(*stores, return_exceptions=True)
            shed = [r for r in results if isinstance(r, Overloaded)]
            done = [r for r in results if isinstance(r, p.Ack)]
            assert len(shed) + len(done) == len(results), results
            st = await c.stats()
            await c.close()
            return look, len(shed), len(done), st
        look, shed, done, st = asyncio.run(go())
        assert look.matched == 0
        assert shed >= 1 and done >= 1
        assert st["daemon"]["shed"] == shed and st["daemon"]["queue_depth"] == 0
    finally:
        d.stop()


def test_pins_are_released_when_a_worker_goes_silent(tmp_path):
    d = DaemonProc(tmp_path, host="1MiB", worker_timeout_s=1.0).start()
    try:
        a, b = d.client(), d.client()
        a.register(LAYOUT, worker_id="a")
        b.register(LAYOUT, worker_id="b")
        ks = keys(4, b"pin")
        a.store(ks, [payload(k) for k in ks])
        rep = a.request(p.Onboard(namespace=LAYOUT.namespace, hashes=[k.hash for k in ks]), p.Onboarded)
        assert rep.count == 4
        assert b.stats()["daemon"]["pins"] == 4
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = b.stats()["daemon"]
            if st["pins"] == 0:
                break
            time.sleep(0.2)
        assert st["pins"] == 0 and st["expired_workers"] >= 1
        # Its lease is gone; the client registers again by itself and carries on.
        old = a.token
        a.ping()
        assert a.token != old
        new, a.token = a.token, old
        with pytest.raises(DaemonError) as ei:  # the stale token is refused (Release is never resent)
            a.request(p.Release(namespace=LAYOUT.namespace, hashes=[]), p.Released)
        assert ei.value.code == p.E_UNREGISTERED
        a.token = new
        a.close()
        b.close()
    finally:
        d.stop()


def test_durable_blocks_survive_kill9_and_no_torn_block_is_served(tmp_path):
    d = DaemonProc(tmp_path, host="2MiB", fsync=True).start()
    acked, attempted = [], []
    stop = threading.Event()

    def writer():
        c = d.client(timeout_s=8)  # generous: fsync on a loaded 2-core box can be slow
        c.register(LAYOUT, worker_id="writer")
        i = 0
        try:
            while not stop.is_set():
                ks = keys(2, b"k9-%d-" % i)
                attempted.extend(ks)
                c.store(ks, [payload(k) for k in ks], durable=True)
                acked.extend(ks)
                i += 1
        except (DaemonUnavailable, DaemonError):
            pass
        finally:
            c._detach()
            c._reset()

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 16 and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    d.kill9()  # mid-offload: the writer is storing continuously
    stop.set()
    t.join(30)
    try:
        assert len(acked) >= 16, d.log_path.read_text()[-2000:]
        d.start()
        assert not glob.glob(f"/dev/shm/kvbm-g2-{d.killed}-*")  # serve removed the dead daemon's pool
        with d.client() as c:
            c.register(LAYOUT, worker_id="reader")
            assert c.lookup(acked).matched == len(acked)
            for lo in range(0, len(acked), 8):  # G2 holds 32 blocks: onboard in chunks
                chunk = acked[lo:lo + 8]
                outs = [np.zeros(NB, np.uint8) for _ in chunk]
                assert c.load(chunk, outs) == len(chunk)
                for k, o in zip(chunk, outs, strict=True):
                    assert np.array_equal(o, payload(k)), k
            # Blocks that were in flight: either absent or exactly right, never torn.
            for k in attempted[len(acked):]:
                out = np.zeros(NB, np.uint8)
                if c.load([k], [out]):
                    assert np.array_equal(out, payload(k))
    finally:
        d.stop()


def test_daemon_follows_a_vllm_event_stream(tmp_path):
    port = free_port()  # the daemon binds it: not a port the kernel may hand an outgoing connection meanwhile
    d = DaemonProc(tmp_path, vllm_events=[f"tcp://127.0.0.1:{port}"]).start()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(f"tcp://127.0.0.1:{port}")  # vLLM connects to a concrete tcp endpoint
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="v")
            time.sleep(0.5)
            for seq in range(5):
                ev = {"type": "BlockStored", "block_hashes": [seq * 2, seq * 2 + 1], "parent_block_hash": None,
                      "token_ids": [1] * 32, "block_size": 16, "lora_id": None, "medium": "GPU",
                      "lora_name": None}
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [ev]])])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                eng = c.stats()["engines"]
                if eng and next(iter(eng.values()))["events"] == 5:
                    break
                time.sleep(0.1)
            view = next(iter(eng.values()))
            assert view["blocks"] == {"GPU": 10} and view["last_seq"] == 4
        with d.client(admin=True) as c:  # resident hashes are for an admin session only
            c.register(LAYOUT, worker_id="v-admin")
            detail = next(iter(c.stats(resident=True)["engines"].values()))
            assert sorted(detail["resident"]) == list(range(10))
    finally:
        pub.close(0)
        d.stop()


def _requests(c):
    return c.stats()["daemon"]["requests"]


def test_a_large_store_goes_in_pipelined_batches_and_a_failed_copy_loses_nothing(daemon):
    """More than ``store_batch`` blocks go in batches of that many (the next batch prepared while this one is
    copied); host buffers of any kind land byte-exact. A copy that fails mid-way aborts its batch and the one
    prepared ahead: the batches committed before it stay, and no slot is left reserved for the rest."""
    import torch

    with daemon.client() as c:
        c.register(LAYOUT, worker_id="pipe")
        c.store_batch = 8
        ks = keys(20, b"pipe")
        data = [payload(k) for k in ks]
        bufs = [d if i % 3 == 0 else torch.from_numpy(d) if i % 3 == 1 else d.tobytes() for i, d in enumerate(data)]
        before = _requests(c)
        assert c.store(ks, bufs).stored == 20
        assert _requests(c) - before - 1 == 2 * 3  # a PrepareStore and a CommitStore per batch of 8 (+ the Stats)
        outs = [np.zeros(NB, dtype=np.uint8) for _ in ks]
        assert c.load(ks, outs) == 20
        assert all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))

        ks = keys(20, b"fail")
        bufs = [payload(k) for k in ks]
        bufs[12] = torch.empty(NB, dtype=torch.uint8, device="meta")  # the copy of batch 2 (blocks 8..15) fails
        with pytest.raises(NotImplementedError):
            c.store(ks, bufs)
        assert c.lookup(ks).matched == 8  # batch 1 was committed before the failure; nothing after it
        assert c.stats()["tiers"][0]["detached_slots"] == 0
        bufs[12] = payload(ks[12])
        assert c.store(ks, bufs).stored == 12  # nothing of blocks 8..19 was left prepared (held back as "being stored")


def test_a_store_of_more_blocks_than_one_request_may_carry_is_stored_with_an_event_per_block(tmp_path):
    """A store of more than MAX_BATCH blocks used to be refused (E_LIMIT on the one request it became); it is
    split into pipelined batches, stored byte-exact from a 2-D array of rows, and every block is published once."""
    small = KVLayout(model="tiny-rows", num_layers=1, num_kv_heads=1, head_size=16, dtype="float16",
                     tokens_per_block=16)
    nb = small.block_nbytes
    n = p.MAX_BATCH + 1000
    d = ServeProc(tmp_path, {
        "block_bytes": nb, "device": {"enabled": False}, "host": {"capacity": (n + 64) * nb, "pin": False},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp_path}/kvbm.sock", "events_endpoint": f"ipc://{tmp_path}/events.sock",
                   "metrics_port": -1},
    }).start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(d.info["events"])
    time.sleep(0.3)  # PUB/SUB slow joiner
    try:
        with d.client(timeout_s=60.0) as c:
            c.register(small, worker_id="rows")
            ks = [BlockKey(small.namespace, i.to_bytes(8, "big") + b"\x5a" * 8) for i in range(n)]
            rows = np.random.default_rng(5).integers(0, 256, (n, nb), dtype=np.uint8)
            assert c.store(ks, rows).stored == n
            for lo in (0, p.MAX_BATCH - 3, n - 5):
                outs = [np.zeros(nb, dtype=np.uint8) for _ in range(5)]
                assert c.load(ks[lo : lo + 5], outs) == 5
                assert all(np.array_equal(o, rows[lo + i]) for i, o in enumerate(outs))
            stored: list[bytes] = []
            deadline = time.monotonic() + 60
            while len(stored) < n and time.monotonic() < deadline:
                if not sub.poll(1000):
                    continue
                for ev in p.decode_events(sub.recv_multipart()[2]).events:
                    if isinstance(ev, p.BlocksStored):
                        assert ev.tier == "G2" and ev.namespace == small.namespace and ev.nbytes == nb
                        stored += ev.hashes
            assert len(stored) == n and set(stored) == {k.hash for k in ks}
    finally:
        sub.close(0)
        d.stop()


def test_the_async_client_splits_a_large_store_into_batches_byte_exact(daemon):
    """AsyncWorkerClient: more than ``store_batch`` blocks go in batches (a store beyond MAX_BATCH used to be one
    request, refused E_LIMIT); every block lands byte-exact."""

    async def go():
        c = AsyncWorkerClient(daemon.endpoint, timeout_s=20)
        await c.register(LAYOUT, worker_id="async-batches")
        c.store_batch = 8
        ks = keys(20, b"abatch")
        data = [payload(k) for k in ks]
        before = (await c.stats())["daemon"]["requests"]
        ack = await c.store(ks, data)
        after = (await c.stats())["daemon"]["requests"]
        outs = [np.zeros(NB, dtype=np.uint8) for _ in ks]
        loaded = await c.load(ks, outs)
        await c.close()
        return ack, after - before - 1, loaded, outs, data

    ack, requests, loaded, outs, data = asyncio.run(go())
    assert ack.stored == 20 and requests == 2 * 3  # a PrepareStore and a CommitStore per batch of 8
    assert loaded == 20 and all(np.array_equal(o, d) for o, d in zip(outs, data, strict=True))


def test_a_cancelled_async_store_never_lets_its_copy_land_in_another_workers_slots(tmp_path):
    """The G2 pool has 8 slots. Worker A's store is cancelled while its copy thread still writes the slots;
    worker B stores 8 other blocks at once, retrying while the pool is full. B's blocks must load with B's
    bytes: A gives its slots back only after its copy thread is done (before, the abort freed them at once
    and the late copy overwrote B's blocks)."""
    d = DaemonProc(tmp_path, host="512KiB", disk=False).start()  # 8 slots of 64 KiB
    try:
        async def go():
            a = AsyncWorkerClient(d.endpoint, timeout_s=20)
            b = AsyncWorkerClient(d.endpoint, timeout_s=20)
            await a.register(LAYOUT, worker_id="a")
            await b.register(LAYOUT, worker_id="b")
            copy_in = a._copy_in
            started = threading.Event()

            def slow_copy(slots, bufs, n):
                started.set()
                time.sleep(1.5)  # the copy is still running when the caller is cancelled
                copy_in(slots, bufs, n)

            a._copy_in = slow_copy
            ka, kb = keys(8, b"cancel-a"), keys(8, b"cancel-b")
            task = asyncio.ensure_future(a.store(ka, [payload(k) for k in ka]))
            await asyncio.to_thread(started.wait, 10)
            task.cancel()
            data = [payload(k) for k in kb]
            deadline = time.monotonic() + 30
            while (await b.lookup(kb)).matched < len(kb) and time.monotonic() < deadline:
                try:
                    await b.store(kb, data)
                except DaemonError:
                    pass  # the pool is full while A's slots are still out
                await asyncio.sleep(0.05)
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.sleep(2.0)  # let any orphaned copy finish before reading back
            outs = [np.zeros(NB, dtype=np.uint8) for _ in kb]
            n = await b.load(kb, outs)
            await a.close()
            await b.close()
            return n, outs, data

        n, outs, data = asyncio.run(go())
        assert n == 8
        wrong = [i for i, (o, x) in enumerate(zip(outs, data, strict=True)) if not np.array_equal(o, x)]
        assert wrong == [], f"blocks {wrong} hold another worker's bytes"
    finally:
        d.stop()


def test_a_2d_bfloat16_tensor_of_blocks_stores_byte_exact(daemon):
    """One row per block, as KV rows come out of a model (bf16 has no numpy dtype)."""
    ks = keys(4, b"bf16rows")
    rows = torch.randn(4, NB // 2, dtype=torch.float32).to(torch.bfloat16)
    with WorkerClient(daemon.endpoint, timeout_s=20) as c:
        c.register(LAYOUT, worker_id="bf16")
        assert c.store(ks, rows).stored == 4
        outs = [np.zeros(NB, dtype=np.uint8) for _ in ks]
        assert c.load(ks, outs) == 4
    for o, r in zip(outs, rows, strict=True):
        assert bytes(o) == r.view(torch.uint8).numpy().tobytes()


def test_a_daemon_at_max_inflight_does_not_spin_while_requests_wait(tmp_path):
    """With every handler slot taken (one Barrier waiting for a second rank) and more requests queued, the
    daemon waits for a slot to free without burning CPU (before: its loop spun on the readable socket)."""
    d = DaemonProc(tmp_path, max_inflight=1).start()
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="spin")
            stat = Path(f"/proc/{d.proc.pid}/stat")

            def cpu_s():
                f = stat.read_text().rsplit(")", 1)[1].split()
                return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

            def wait_for_a_second_rank():
                with contextlib.suppress(DaemonError, DaemonUnavailable):
                    c.barrier("engine", 1, 0, 2, 4.0)  # holds the one handler slot for 4 s

            blocked = threading.Thread(target=wait_for_a_second_rank)
            with WorkerClient(d.endpoint, timeout_s=30) as other:
                other.register(LAYOUT, worker_id="spin-2")
                blocked.start()
                time.sleep(0.5)
                before = cpu_s()
                waiting = threading.Thread(target=other.ping)  # queued behind the barrier
                waiting.start()
                time.sleep(3.0)
                used = cpu_s() - before
                blocked.join(30)
                waiting.join(30)
        assert used < 0.5, f"the daemon used {used:.2f} CPU-s in 3 s while waiting for a free handler slot"
    finally:
        d.stop()


def test_an_evict_of_g2_alone_lets_the_write_through_to_the_disk_land_first(tmp_path):
    """An Evict of G2 alone frees the memory; the blocks stay on the disk. Evicted right after a store, while the
    store's write-throughs to the disk were still queued (a burst, fsync on), each cascade that had not started found
    no copy left to write from and the block was gone from every tier (CI's flake in test_vllm_outage, round 20)."""
    d = DaemonProc(tmp_path, host="16MiB", fsync=True).start()
    try:
        with d.client(admin=True) as c:
            c.register(LAYOUT, worker_id="burst")
            ks = keys(96, b"ev")
            data = [payload(k) for k in ks]
            assert c.store(ks, data).stored == len(ks)
            ev = c.evict(namespace=LAYOUT.namespace, tiers=["G2"])
            assert wait_until(lambda: not c.stats()["manager"]["pending_cascades"], timeout=30)
            look = c.lookup(ks)
            assert look.matched == len(ks), f"lost {len(ks) - look.matched} blocks; evicted {ev}"
            assert ev.removed + ev.skipped == len(ks)
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == len(ks)
            assert all(np.array_equal(o, x) for o, x in zip(outs, data, strict=True))
    finally:
        d.stop()


def test_an_evict_of_g2_during_a_durable_store_lets_its_write_through_to_the_disk_land_first(tmp_path):
    """A durable store's write-throughs are not background cascades (the commit awaits them, 32 at a time): an Evict of
    G2 while they queued deleted the blocks whose turn had not come, gone from every tier, as round 20's loss."""
    d = DaemonProc(tmp_path, host="16MiB", fsync=True).start()
    try:
        with d.client(admin=True) as c, d.client() as w:
            w.register(LAYOUT, worker_id="durable")
            c.register(LAYOUT, worker_id="operator")
            ks = keys(96, b"dur")
            data = [payload(k) for k in ks]
            acks: list[p.Ack] = []
            th = threading.Thread(target=lambda: acks.append(w.store(ks, data, durable=True)))
            th.start()
            try:
                assert wait_until(lambda: c.lookup(ks).matched == len(ks), timeout=30, step=0.002)
                ev = c.evict(namespace=LAYOUT.namespace, tiers=["G2"])
            finally:
                th.join(60)
            assert acks and acks[0].stored == len(ks)
            look = c.lookup(ks)
            assert look.matched == len(ks), f"lost {len(ks) - look.matched} blocks; evicted {ev}, ack {acks[0]}"
            assert acks[0].durable == len(ks)
            outs = [np.zeros(NB, np.uint8) for _ in ks]
            assert c.load(ks, outs) == len(ks)
            assert all(np.array_equal(o, x) for o, x in zip(outs, data, strict=True))
    finally:
        d.stop()
