"""Slot lifetimes and daemon restarts, against real parts: a daemon subprocess, real shared memory,
real files. Every loaded block is checked byte for byte."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
from needs import skip
from serve_proc import ServeProc

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError
from kvbm.tiers import host as host_mod
from kvbm.tiers.host import HostTier, shm_path

SLOT = 64 * 1024
LAYOUT = KVLayout(model="slots", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes
HERE = Path(__file__).parent


def keys(n, tag=b""):
    return [BlockKey(LAYOUT.namespace, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def payload(key):
    rng = np.random.default_rng(int.from_bytes(key.hash[:10], "big"))
    return rng.integers(0, 256, NB, dtype=np.uint8)


def daemon_cfg(tmp, *, host="2MiB", shm_name="", fsync=False, io_threads=4, **daemon):
    return {
        "block_bytes": SLOT,
        "device": {"enabled": False},
        "host": {"capacity": host, "shm_name": shm_name},
        "disk": {"dir": str(tmp / "disk"), "capacity": "256MiB", "fsync": fsync, "o_direct": False},
        "s3": {"enabled": False},
        "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain", "io_threads": io_threads},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": "", "metrics_port": 0, **daemon},
    }


def load_all(c, ks):
    outs = [np.zeros(NB, np.uint8) for _ in ks]
    n = c.load(ks, outs)
    return n, [bool(np.array_equal(o, payload(k))) for k, o in zip(ks[:n], outs, strict=False)]


@pytest.mark.parametrize("how", ["kill9", "clean"])
def test_fixed_shm_name_client_remaps_across_a_daemon_restart(tmp_path, how):
    name = f"kvbm-slots-{uuid.uuid4().hex[:8]}"
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, shm_name=name)).start()
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="survivor")
        first = c.registered
        before = keys(4, b"before")
        c.store(before, [payload(k) for k in before], durable=True)
        assert load_all(c, before) == (4, [True] * 4)
        if how == "kill9":
            d.kill9()
        else:
            d.stop()
        d.start()
        # The same client object carries on: it registers again and must map the new pool.
        after = keys(4, b"after")
        assert c.store(after, [payload(k) for k in after]).stored == 4
        with d.client() as fresh:
            fresh.register(LAYOUT, worker_id="fresh")
            assert load_all(fresh, after) == (4, [True] * 4)  # what the survivor stored is right
            more = keys(4, b"fresh")
            fresh.store(more, [payload(k) for k in more])
        assert load_all(c, more) == (4, [True] * 4)  # and what it loads is right
        assert load_all(c, before) == (4, [True] * 4)  # durable blocks come back from disk
        assert c.registered.generation != first.generation
        c.close()
    finally:
        d.stop()
        shm_path(name).unlink(missing_ok=True)


def test_slot_request_with_a_stale_generation_is_refused(tmp_path):
    d = ServeProc(tmp_path, daemon_cfg(tmp_path)).start()
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="stale")
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
            hashes = [k.hash for k in keys(1, b"stale")]
            for msg in (p.PrepareStore(namespace=LAYOUT.namespace, hashes=hashes, nbytes=NB),
                        p.Onboard(namespace=LAYOUT.namespace, hashes=hashes),
                        p.CommitStore(namespace=LAYOUT.namespace, hashes=hashes)):
                msg.token, msg.generation, msg.rid = c.token, "0" * 16, 7
                s.send(p.encode(msg))
                assert s.poll(10_000)
                reply = p.decode_reply(s.recv())
                assert isinstance(reply, p.Error) and reply.code == p.E_STALE, reply
                assert "generation" in reply.message
            s.close(0)
            # The client's own requests carry the current generation and go through.
            assert c.store(keys(1, b"stale"), [payload(keys(1, b"stale")[0])]).stored == 1
    finally:
        d.stop()


def _dead_pid() -> int:
    for pid in range(32000, 300, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid")


def test_remove_stale_pools_keeps_a_pool_whose_owner_holds_the_lock(tmp_path):
    from kvbm.tiers.host import remove_stale_pools

    pid = _dead_pid()
    live = f"kvbm-g2-{pid}-live{uuid.uuid4().hex[:4]}"
    dead = f"kvbm-g2-{pid}-dead{uuid.uuid4().hex[:4]}"
    half = host_mod.SHM_DIR / f".kvbm-new-{pid}-{uuid.uuid4().hex[:4]}"  # a creator died mid-way
    # A live owner in "another PID namespace": its name carries a pid that does not exist here.
    code = ("import sys, time; from kvbm.tiers.host import HostTier; "
            f"HostTier(1 << 20, 1 << 20, {live!r}, pin=False); print('up', flush=True); sys.stdin.read()")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        shm_path(dead).write_bytes(b"\0" * 4096)  # left by an owner that died: nobody holds its lock
        half.write_bytes(b"")
        os.utime(half, (time.time() - 120, time.time() - 120))
        removed = remove_stale_pools()
        assert dead in removed and not shm_path(dead).exists()
        assert half.name in removed and not half.exists()
        assert live not in removed and shm_path(live).exists()
    finally:
        owner.stdin.close()
        owner.wait(10)
        shm_path(live).unlink(missing_ok=True)
        shm_path(dead).unlink(missing_ok=True)
        half.unlink(missing_ok=True)


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        skip("tmpfs", f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    monkeypatch.setattr(host_mod, "SHM_DIR", mnt)
    yield mnt
    for _ in range(20):
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)


def test_g2_pool_larger_than_shared_memory_fails_at_creation(small_shm):
    from kvbm.errors import KvbmError

    with pytest.raises(KvbmError, match="shared memory") as ei:
        HostTier(64 << 20, 1 << 20, "kvbm-too-big", pin=False)
    assert "64" in str(ei.value) and str(small_shm) in str(ei.value)
    assert not (small_shm / "kvbm-too-big").exists()  # nothing left behind
    ok = HostTier(8 << 20, 1 << 20, "kvbm-fits", pin=False)  # one that fits is created and usable
    ok.slot_tensor(7).fill_(7)
    assert int(ok.slot_tensor(7)[-1]) == 7
    ok.release()


def test_concurrent_prepare_of_a_key_being_prefetched_gets_a_per_key_answer(tmp_path):
    """A prefetch (G3 -> G2) holds a pending slot for the key; a worker's prepare of it is told
    "being stored" (None) for that key instead of failing its whole batch."""
    from kvbm.manager.core import BlockManager
    from kvbm.tiers.disk import DiskTier
    from kvbm.transfer import PlainFileIO

    async def go():
        g2 = HostTier(8 * SLOT, SLOT, pin=False)
        g3 = DiskTier(tmp_path / "d", 64 << 20, PlainFileIO())
        m = BlockManager([g2, g3])
        await m.start()
        try:
            k, other = keys(2, b"pf")
            await m.put(k, payload(k).tobytes(), "G3")
            task = asyncio.ensure_future(m.onboard([k], to="G2"))
            for _ in range(100_000):
                if k in g2._pending:
                    break
                await asyncio.sleep(0)
            assert k in g2._pending
            slots = await m.prepare_store([k, other], NB)
            assert slots[0] is None and isinstance(slots[1], int)
            assert await task == 1
            g2.slot_tensor(slots[1], NB).copy_(torch_from(payload(other)))
            assert m.complete_store([k, other]) == 1
            for key in (k, other):
                assert bytes(g2.block_tensor(key).numpy()) == payload(key).tobytes()
        finally:
            await m.close()

    asyncio.run(go())


def torch_from(arr):
    import torch

    return torch.from_numpy(arr)


def test_two_workers_prepare_the_same_key(tmp_path):
    d = ServeProc(tmp_path, daemon_cfg(tmp_path)).start()
    try:
        with d.client() as a, d.client() as b:
            a.register(LAYOUT, worker_id="a")
            b.register(LAYOUT, worker_id="b")
            k, k2 = keys(2, b"same")
            ns = LAYOUT.namespace
            sa = a.request(p.PrepareStore(namespace=ns, hashes=[k.hash], nbytes=NB), p.Slots).slots
            sb = b.request(p.PrepareStore(namespace=ns, hashes=[k.hash, k2.hash], nbytes=NB), p.Slots).slots
            assert isinstance(sa[0], int) and sb[0] is None and isinstance(sb[1], int)
            a._copy_in(sa, [payload(k)], NB)
            b._copy_in(sb, [payload(k), payload(k2)], NB)
            assert b.request(p.CommitStore(namespace=ns, hashes=[k.hash, k2.hash]), p.Ack).stored == 1
            assert a.request(p.CommitStore(namespace=ns, hashes=[k.hash]), p.Ack).stored == 1
            assert load_all(b, [k, k2]) == (2, [True, True])
    finally:
        d.stop()


def test_expired_worker_slots_stay_quarantined_until_its_commit_is_refused(tmp_path):
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, host=f"{8 * SLOT}", worker_timeout_s=1.0)).start()
    try:
        slow, other = d.client(), d.client()
        slow.register(LAYOUT, worker_id="slow")
        other.register(LAYOUT, worker_id="other")
        ns = LAYOUT.namespace
        mine = keys(3, b"slow")
        held = slow.request(p.PrepareStore(namespace=ns, hashes=[k.hash for k in mine], nbytes=NB), p.Slots).slots
        deadline = time.monotonic() + 20
        while other.stats()["daemon"]["expired_workers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            other.ping()
        assert other.stats()["daemon"]["expired_workers"] >= 1
        # The slow worker is still copying into its slots: nobody else may be handed them.
        given = []
        for i in range(8):
            ks = keys(1, b"o%d" % i)
            try:
                got = other.request(p.PrepareStore(namespace=ns, hashes=[ks[0].hash], nbytes=NB), p.Slots).slots
            except DaemonError as e:
                assert e.code == p.E_FULL
                break
            given += got
            other._copy_in(got, [payload(ks[0])], NB)
            other.request(p.CommitStore(namespace=ns, hashes=[ks[0].hash]), p.Ack)
        assert given and not set(given) & set(held)
        st = other.stats()
        assert st["daemon"]["quarantined_slots"] == 3
        assert next(t for t in st["tiers"] if t["tier"] == "G2")["detached_slots"] == 3
        slow._copy_in(held, [payload(k) for k in mine], NB)
        tok = slow.token
        with pytest.raises(DaemonError) as ei:
            slow.request(p.CommitStore(namespace=ns, hashes=[k.hash for k in mine]), p.Ack)
        assert ei.value.code == p.E_UNREGISTERED and "expired" in ei.value.message
        assert slow.token == tok  # a CommitStore is never resent under a new registration
        # Its commit was refused, so its slots are free again; the block it wrote was not stored.
        assert other.lookup(mine).matched == 0
        st = other.stats()
        assert st["daemon"]["quarantined_slots"] == 0
        assert next(t for t in st["tiers"] if t["tier"] == "G2")["detached_slots"] == 0
        slow.close()
        other.close()
    finally:
        d.stop()


def test_stress_store_onboard_evict_prefetch_on_the_same_keys_is_byte_exact(tmp_path):
    seconds = float(os.environ.get("KVBM_STRESS_S", "20"))
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, host=f"{32 * SLOT}", fsync=True, io_threads=1, prefetch=True)).start()
    try:
        roles = ["writer", "writer", "reader", "reader", "reader", "evictor", "evictor"]
        procs = [subprocess.Popen([sys.executable, str(HERE / "slots_stress_worker.py"), role, d.endpoint,
                                   str(seconds), str(i), str(d.admin_token_path)], stdout=subprocess.PIPE, text=True)
                 for i, role in enumerate(roles)]
        results = []
        for pr in procs:
            out, _ = pr.communicate(timeout=seconds + 120)
            assert pr.returncode == 0, out
            results.append(json.loads(out.strip().splitlines()[-1]))
        loaded = sum(r["loaded"] for r in results)
        wrong = sum(r["wrong"] for r in results)
        print(f"stress {seconds:g}s: loaded {loaded}, wrong {wrong}, "
              f"stored {sum(r['stored'] for r in results)}, evicted {sum(r['evicted'] for r in results)}, "
              f"full/shed {sum(r['full'] for r in results)}")
        assert wrong == 0, f"{wrong} of {loaded} loaded blocks had another block's bytes"
        errors = [e for r in results for e in r["errors"]]
        assert not errors, errors[:5]
        assert loaded >= 50 and sum(r["evicted"] for r in results) > 0
        assert d.proc.poll() is None
    finally:
        d.stop()


def _fill(pool, tag, n):
    """Store ``n`` new blocks until the pool has no free slot; returns the slots they took."""
    taken = []
    for i in range(n):
        k = keys(1, tag + b"%d" % i)[0]
        try:
            slot = pool.allocate(k, NB)
        except Exception:
            break
        pool.slot_tensor(slot, NB).fill_(0xEE)
        pool.commit(k)
        taken.append(slot)
    return taken


def test_a_removed_slot_is_not_reused_while_a_reader_holds_it():
    g2 = HostTier(4 * SLOT, SLOT, pin=False)
    try:
        k = keys(1, b"held")[0]
        asyncio.run(g2.put(k, payload(k).tobytes()))
        slot, n = g2.acquire(k)  # a worker onboarded it and copies out of the slot
        assert g2.remove(k) and g2.nbytes(k) is None  # an Evict: the key is gone at once
        assert slot not in _fill(g2, b"new", 8)  # but its slot is handed to no one
        assert bytes(g2.slot_tensor(slot, n).numpy()) == payload(k).tobytes()
        assert g2.detached_slots() == 1 and g2.free_slots() == 0
        g2.unref(slot)  # the reader is done: now it is free
        assert g2.detached_slots() == 0 and g2.free_slots() == 1
    finally:
        g2.release()


def test_commit_over_a_committed_key_keeps_the_slot_readers_use():
    g2 = HostTier(4 * SLOT, SLOT, pin=False)
    try:
        k = keys(1, b"twice")[0]
        asyncio.run(g2.put(k, payload(k).tobytes()))
        with g2.hold(k) as view:  # a cascade copying the block out
            again = g2.allocate(k, NB)  # a second copy of the same block (e.g. a re-store)
            g2.slot_tensor(again, NB).copy_(torch_from(payload(k)))
            assert g2.commit(k) is False  # a no-op: the first copy stays
            assert g2.slot_of(k) != again
            _fill(g2, b"new", 8)
            assert bytes(view.numpy()) == payload(k).tobytes()
        assert bytes(g2.block_tensor(k).numpy()) == payload(k).tobytes()
    finally:
        g2.release()


def test_quarantine_ends_after_its_grace_period_and_unregister_releases_at_once():
    from kvbm.daemon.sessions import Sessions
    from kvbm.manager.core import BlockManager

    async def go():
        g2 = HostTier(4 * SLOT, SLOT, pin=False)
        m = BlockManager([g2])
        await m.start()
        try:
            sessions = Sessions(m, "G2", grace_s=0.3)
            reg = p.Register(worker_id="w", engine_id="e", layout=LAYOUT)
            for quarantine in (True, False):
                w = sessions.add(f"tok-{quarantine}", reg)
                k, held = keys(2, b"q%d" % quarantine)
                await m.put(held, payload(held).tobytes(), "G2")
                sessions.pin(w, await m.reserve_read([held]))  # Onboard's lease: pinned, its slot referenced
                slots = await m.prepare_store([k], NB)
                sessions.prepared(w, [k], slots)
                assert sessions.drop(w, quarantine=quarantine, why="lease expired") == 1
                assert not m.registry.is_pinned(held) and not g2.is_pending(k)
                assert (await m.prepare_store([k], NB))[0] is not None  # the key may be stored again
                m.complete_store([k], ok=False)
                if quarantine:
                    assert sessions.quarantined_slots() == 2 and g2.detached_slots() == 1  # + the pinned slot
                    deadline = time.monotonic() + 10
                    while sessions.reap_quarantine() == 0 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                assert sessions.quarantined_slots() == 0 and g2.detached_slots() == 0
                assert g2.free_slots() == g2.num_slots - len(g2._index)
        finally:
            await m.close()

    asyncio.run(go())


def test_prepare_evicts_for_a_free_slot_when_removed_blocks_still_hold_theirs(tmp_path):
    from kvbm.manager.core import BlockManager
    from kvbm.tiers.disk import DiskTier
    from kvbm.transfer import PlainFileIO

    async def go():
        g2 = HostTier(4 * SLOT, SLOT, pin=False)
        m = BlockManager([g2, DiskTier(tmp_path / "d", 64 << 20, PlainFileIO())])
        await m.start()
        try:
            ks = keys(5, b"room")
            for k in ks[:4]:
                await m.put(k, payload(k).tobytes(), "G2")
            await m.drain()
            slot, _n = g2.acquire(ks[0])  # a reader copies block 0 out
            assert await m.delete([ks[0]], ["G2"]) == 1  # an Evict meanwhile: 3 blocks, no free slot
            assert g2.free_slots() == 0 and m.registry.used("G2") == 3 * SLOT
            slots = await m.prepare_store([ks[4]], NB)  # evicts an LRU block rather than failing "full"
            assert isinstance(slots[0], int) and slots[0] != slot
            g2.slot_tensor(slots[0], NB).copy_(torch_from(payload(ks[4])))
            assert m.complete_store([ks[4]]) == 1
            assert bytes(g2.slot_tensor(slot, NB).numpy()) == payload(ks[0]).tobytes()  # the reader's bytes
            g2.unref(slot)
            assert await m.read(ks[0]) == payload(ks[0]).tobytes()  # still on disk
        finally:
            await m.close()

    asyncio.run(go())


def test_the_load_path_leases_slots_through_the_manager():
    """The manager owns the read lease (reserve_read/detach_read/release, mirroring prepare/complete/detach of
    stores): a lease pins the block and references its very slot, detach lets the block go but keeps the slot,
    release frees both exactly once. The daemon's Onboard handler and sessions hold leases and never reach
    into the registry or the G2 pool themselves."""
    import ast

    import kvbm.daemon.service
    import kvbm.daemon.sessions
    from kvbm.manager.core import BlockManager

    for mod in (kvbm.daemon.service, kvbm.daemon.sessions):
        tree = ast.parse(Path(mod.__file__).read_text())
        reached = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                         & {"registry", "acquire", "unref", "pool"})
        assert not reached, f"{mod.__name__} reaches into {reached}"

    async def go():
        g2 = HostTier(4 * SLOT, SLOT, pin=False)
        m = BlockManager([g2])
        await m.start()
        try:
            ks = keys(3, b"lease")
            for k in ks[:2]:
                await m.put(k, payload(k).tobytes(), "G2")
            leases = await m.reserve_read(ks)  # the leading held run: 2 of 3
            assert [lease.key for lease in leases] == ks[:2] and all(m.registry.is_pinned(k) for k in ks[:2])
            assert not m.registry.is_pinned(ks[2]) and [lease.nbytes for lease in leases] == [NB, NB]
            assert bytes(g2.slot_tensor(leases[0].slot, NB).numpy()) == payload(ks[0]).tobytes()
            m.detach_read(leases[:1])  # a stalled reader's: evictable again, its slot still referenced
            assert not m.registry.is_pinned(ks[0])
            assert m.registry.remove(g2.name, ks[0]) and g2.remove(ks[0])  # then evicted (an Evict)
            assert g2.detached_slots() == 1  # its slot is handed to no one while the reader may copy
            assert m.release(leases) == 2 and m.release(leases) == 0  # once only
            assert g2.detached_slots() == 0 and not m.registry.is_pinned(ks[1])
        finally:
            await m.close()

    asyncio.run(go())


def test_a_load_fills_every_kind_of_host_output_byte_exact(tmp_path):
    """Host outputs are copied through numpy, device tensors through torch: each kind a worker may hand in is
    written in place (uint8 and other dtypes, torch CPU tensors, a bytearray, a buffer larger than the block)."""
    import torch

    d = ServeProc(tmp_path, daemon_cfg(tmp_path)).start()
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="outs")
            ks = keys(5, b"outs")
            assert c.store(ks, [payload(k) for k in ks]).stored == 5
            outs = [np.zeros(NB, np.uint8), np.zeros(NB // 2, np.float16), torch.zeros(NB // 2, dtype=torch.bfloat16),
                    bytearray(NB), np.zeros(NB + 64, np.uint8)]
            assert c.load(ks, outs) == 5
            got = [outs[0], outs[1].view(np.uint8), outs[2].view(torch.uint8).numpy(), np.frombuffer(outs[3], np.uint8),
                   outs[4][:NB]]
            assert [bool(np.array_equal(g, payload(k))) for g, k in zip(got, ks, strict=True)] == [True] * 5
            assert not outs[4][NB:].any()
    finally:
        d.stop()
