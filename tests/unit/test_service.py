"""The daemon's request handlers called directly, without ZeroMQ: a real G2 shared-memory pool and a real
disk tier, the Service wired by a Daemon that never binds a socket."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.config import load_config
from kvbm.daemon import Daemon, Handled
from kvbm.stack import build_stack

SLOT = 64 * 1024
LAYOUT = KVLayout(model="svc", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes
ADMIN = "a" * 64


def hashes(n, tag=b""):
    return [(tag + i.to_bytes(4, "big")).ljust(32, b"\x00") for i in range(n)]


def payload(h):
    return np.random.default_rng(int.from_bytes(h[:10], "big")).integers(0, 256, NB, dtype=np.uint8)


def run_with_daemon(tmp_path, body):
    cfg_path = tmp_path / "kvbm.yaml"
    cfg_path.write_text(json.dumps({
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "2MiB"},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp_path}/kvbm.sock", "events_endpoint": "", "metrics_port": 0,
                   "barrier_timeout_s": 0.2},
    }))

    async def go():
        stack = await build_stack(load_config(cfg_path), device=False)
        try:
            d = Daemon(stack.cfg, stack.manager)
            d.service.admin_token = ADMIN
            await body(d.service, d)
            assert d.transport._router is None  # no socket was ever bound
        finally:
            await stack.manager.close()

    asyncio.run(go())


async def register(svc, worker="w0", *, admin="", rank=0, size=1):
    msg = p.Register(worker_id=worker, engine_id="e0", layout=LAYOUT, tp_rank=rank, tp_size=size, admin_token=admin)
    assert svc.admit(msg) is None
    reg = await svc.register(msg, None)
    return reg, svc.admit(p.Ping(token=reg.token))


def test_store_lookup_onboard_release_through_the_handlers_is_byte_exact(tmp_path):
    async def body(svc, d):
        reg, w = await register(svc)
        hs = hashes(3)
        common = {"token": reg.token, "namespace": reg.namespace, "hashes": hs, "generation": reg.generation}
        slots = (await svc.prepare(p.PrepareStore(nbytes=NB, **common), w)).slots
        assert all(s is not None for s in slots)
        g2 = d.g2
        for h, s in zip(hs, slots, strict=True):
            g2.slot_tensor(s, NB).numpy()[:] = payload(h)
        ack = await svc.commit(p.CommitStore(durable=True, **common), w)
        assert (ack.stored, ack.durable) == (3, 3)  # durable: on disk before the reply
        looked = await svc.lookup(p.Lookup(token=reg.token, namespace=reg.namespace, hashes=[*hs, *hashes(1, b"x")]),
                                  w)
        assert (looked.matched, looked.tiers) == (3, ["G2", "G2", "G2"])
        got = await svc.onboard(p.Onboard(**common), w)
        assert got.count == 3 and got.nbytes == [NB] * 3
        for h, s in zip(hs, got.slots, strict=True):
            assert np.array_equal(g2.slot_tensor(s, NB).numpy(), payload(h))
        assert d.sessions.pin_total() == 3
        assert svc.release(p.Release(**common), w).count == 3
        assert d.sessions.pin_total() == 0

    run_with_daemon(tmp_path, body)


def test_admit_refuses_unknown_tokens_other_namespaces_and_non_admin_evicts(tmp_path):
    async def body(svc, _d):
        reg, _w = await register(svc)
        cases = [
            (p.Lookup(token="nope", namespace=reg.namespace, hashes=[]), p.E_UNREGISTERED),
            (p.Lookup(token=reg.token, namespace="other", hashes=[]), p.E_FORBIDDEN),
            (p.Evict(token=reg.token, namespace=reg.namespace), p.E_FORBIDDEN),
            (p.Stats(token=reg.token, resident=True), p.E_FORBIDDEN),
            (p.Register(worker_id="w9", engine_id="e0", layout=LAYOUT, admin_token="b" * 64), p.E_FORBIDDEN),
        ]
        for msg, code in cases:
            with pytest.raises(Handled) as ei:
                svc.admit(msg)
            assert ei.value.code == code, msg
        assert svc.admit(p.Stats()) is None  # a monitor reads stats unregistered
        admin_reg, admin = await register(svc, "adm", admin=ADMIN)
        assert admin.admin
        assert svc.admit(p.Evict(token=admin_reg.token, namespace=reg.namespace)) is admin

    run_with_daemon(tmp_path, body)


def test_stale_generation_and_foreign_store_are_refused(tmp_path):
    async def body(svc, _d):
        reg, w = await register(svc)
        with pytest.raises(Handled) as ei:
            await svc.prepare(p.PrepareStore(token=reg.token, namespace=reg.namespace, hashes=hashes(1), nbytes=NB,
                                             generation="old"), w)
        assert ei.value.code == p.E_STALE
        with pytest.raises(Handled) as ei:
            await svc.prepare(p.PrepareStore(token=reg.token, namespace="x" * 16, hashes=hashes(1), nbytes=NB,
                                             generation=reg.generation), w)
        assert ei.value.code == p.E_FORBIDDEN

    run_with_daemon(tmp_path, body)


def test_barrier_completes_when_every_rank_arrived_and_reports_a_timeout(tmp_path):
    async def body(svc, _d):
        _r0, w0 = await register(svc, "r0", rank=0, size=2)
        _r1, w1 = await register(svc, "r1", rank=1, size=2)
        both = await asyncio.gather(svc.barrier(p.Barrier(engine_id="e0", step=1, rank=0), w0),
                                    svc.barrier(p.Barrier(engine_id="e0", step=1, rank=1), w1))
        assert [(b.arrived, b.complete) for b in both] == [(2, True), (2, True)]
        alone = await svc.barrier(p.Barrier(engine_id="e0", step=2, rank=0), w0)
        assert (alone.arrived, alone.complete) == (1, False)

    run_with_daemon(tmp_path, body)


def test_evict_skips_pinned_blocks(tmp_path):
    async def body(svc, d):
        reg, w = await register(svc)
        admin_reg, admin = await register(svc, "adm", admin=ADMIN)
        hs = hashes(2, b"ev")
        for h in hs:
            await d.manager.put(BlockKey(reg.namespace, h), payload(h).tobytes(), "G2")
        common = {"token": reg.token, "namespace": reg.namespace, "generation": reg.generation}
        assert (await svc.onboard(p.Onboard(hashes=hs[:1], **common), w)).count == 1
        ev = await svc.admin.evict(p.Evict(token=admin_reg.token, namespace=reg.namespace, tiers=["G2"]), admin)
        assert (ev.removed, ev.skipped) == (1, 1)

    run_with_daemon(tmp_path, body)
