"""``policy.eviction: frequency`` in a real daemon: a block referenced often outlives a stream of one-off blocks
that would flush it out of an LRU (issue 30: the placement policy; the trace figures are in docs/traces.md)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from serve_proc import ServeProc

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout

SLOT = 64 * 1024
LAYOUT = KVLayout(model="tiny-policy", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes
G2_BLOCKS = 16


def _daemon(tmp, eviction):
    return ServeProc(tmp, {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": G2_BLOCKS * SLOT, "pin": False},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"}, "policy": {"eviction": eviction},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock",
                   "metrics_port": -1, "prefetch": False},
    })


def _keys(n, tag):
    return [BlockKey(LAYOUT.namespace, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


@pytest.mark.parametrize("eviction,survives", [("lru", False), ("frequency", True)])
def test_a_block_hit_often_outlives_one_off_blocks(tmp_path, eviction, survives):
    d = _daemon(tmp_path, eviction).start()
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="policy")
            hot = _keys(4, b"hot")
            data = np.random.default_rng(0).integers(0, 256, (4, NB), dtype=np.uint8)
            assert c.store(hot, list(data)).stored == 4
            outs = np.zeros((4, NB), np.uint8)
            for _ in range(3):  # referenced four times in all
                assert c.load(hot, list(outs)) == 4
            assert np.array_equal(outs, data)
            cold = _keys(3 * G2_BLOCKS, b"cold")
            for i in range(0, len(cold), 4):  # one-off blocks, three times G2, each stored once
                assert c.store(cold[i : i + 4], list(np.ones((4, NB), np.uint8))).stored == 4
            assert (c.lookup(hot).matched == 4) is survives
            if survives:
                assert c.load(hot, list(outs)) == 4 and np.array_equal(outs, data)
    finally:
        d.stop()


@pytest.mark.parametrize("eviction,in_g3", [("lru", False), ("frequency", True)])
def test_a_g4_hit_is_promoted_into_g3_too(tmp_path, s3_server, s3_prefix, eviction, in_g3):
    """A block that returned from S3 is worth keeping: with ``frequency`` its Onboard writes it to G3 as well as
    G2 (before, a G4 hit lived in G2 alone and G3 served 0.0015 of the trace's references with S3 on)."""
    cfg = {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": G2_BLOCKS * SLOT, "pin": False},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "16MiB", "fsync": False, "o_direct": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"}, "policy": {"eviction": eviction},
        "daemon": {"endpoint": f"ipc://{tmp_path}/kvbm.sock", "events_endpoint": f"ipc://{tmp_path}/events.sock",
                   "metrics_port": -1, "prefetch": False},
    }
    d = ServeProc(tmp_path, cfg).start()
    try:
        with d.client(admin=True) as c:
            c.register(LAYOUT, worker_id="promote")
            ks = _keys(2, b"promote")
            data = np.random.default_rng(1).integers(0, 256, (2, NB), dtype=np.uint8)
            assert c.store(ks, list(data), durable=True).durable == 2
            c.evict(ks, tiers=["G2", "G3"])
            assert c.lookup(ks).tiers == ["G4", "G4"]
            outs = np.zeros((2, NB), np.uint8)
            assert c.load(ks, list(outs)) == 2 and np.array_equal(outs, data)
            c.evict(ks, tiers=["G2"])
            deadline = time.monotonic() + 10
            while c.lookup(ks).tiers != ["G3", "G3"] and time.monotonic() < deadline and in_g3:
                time.sleep(0.05)
            assert (c.lookup(ks).tiers == ["G3", "G3"]) is in_g3
    finally:
        d.stop()
