"""A store of more blocks than G2 holds streams through G2 (issue 30): a real daemon with a small G2 and a disk.

It used to be refused whole: ``DaemonError full: G2: not enough unpinned blocks to free ...`` (one PrepareStore
reserved a slot per block of the whole store)."""

from __future__ import annotations

import asyncio

import numpy as np
from serve_proc import ServeProc

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import AsyncWorkerClient

SLOT = 64 * 1024
LAYOUT = KVLayout(model="tiny-oversized", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                  block_bytes=SLOT)
NB = LAYOUT.block_nbytes
G2_BLOCKS = 8


def _daemon(tmp):
    return ServeProc(tmp, {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": G2_BLOCKS * SLOT, "pin": False},
        "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock",
                   "metrics_port": -1},
    })


def _keys(n, tag):
    return [BlockKey(LAYOUT.namespace, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def _data(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, NB), dtype=np.uint8)


def _load_all(c, ks, data):
    """Load back in runs of half of G2 (a load, unlike a store, pins what it brings up)."""
    for a in range(0, len(ks), G2_BLOCKS // 2):
        b = min(len(ks), a + G2_BLOCKS // 2)
        outs = np.zeros((b - a, NB), np.uint8)
        assert c.load(ks[a:b], list(outs)) == b - a
        assert np.array_equal(outs, data[a:b])


def test_a_store_larger_than_g2_streams_through_it(tmp_path):
    d = _daemon(tmp_path).start()
    try:
        with d.client() as c:
            c.register(LAYOUT, worker_id="big")
            ks, data = _keys(5 * G2_BLOCKS, b"big"), _data(5 * G2_BLOCKS, 1)
            ack = c.store(ks, list(data), durable=True)
            assert (ack.stored, ack.durable) == (len(ks), len(ks))
            assert c.lookup(ks).matched == len(ks)
            _load_all(c, ks, data)

            async def async_store():
                async with AsyncWorkerClient(d.endpoint, timeout_s=30) as ac:
                    await ac.register(LAYOUT, worker_id="big-async")
                    ks2, data2 = _keys(3 * G2_BLOCKS + 3, b"async"), _data(3 * G2_BLOCKS + 3, 2)
                    ack2 = await ac.store(ks2, list(data2))
                    return ks2, data2, ack2

            ks2, data2, ack2 = asyncio.run(async_store())
            assert ack2.stored == len(ks2)
            _load_all(c, ks2, data2)
    finally:
        d.stop()
