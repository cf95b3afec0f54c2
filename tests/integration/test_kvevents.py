"""The vLLM KV-event subscriber against a publisher built here from vLLM's wire format.

The structs mirror vllm/distributed/kv_events.py (0.32): the batch is array_like, events are tagged
maps (``omit_defaults``); older releases made events array_like too, so both are published.
"""

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvbm.daemon.kvevents import EngineView, KVEventSubscriber


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class LegacyStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    future_field: str = "ignored"


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """vLLM's ZmqEventPublisher, minus the thread: PUB (connects to tcp) + a replay ROUTER."""

    def __init__(self, ctx, endpoint, replay_endpoint, topic=b"kv"):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(endpoint)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(replay_endpoint)
        self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.buffer = []
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()

    async def publish(self, events, drop=False):
        payload = self.enc.encode(EventBatch(ts=time.time(), events=events))
        if not drop:
            await self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.buffer.append((self.seq, payload))
        self.seq += 1

    async def serve_replay(self):
        while True:
            client_id, _, start = await self.replay.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            for seq, buf in self.buffer:
                if seq >= start_seq:
                    await self.replay.send_multipart((client_id, b"", self.topic, seq.to_bytes(8, "big"), buf))
            await self.replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    def close(self):
        self.pub.close(0)
        self.replay.close(0)


def stored(hashes, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                       lora_id=None, medium=medium, lora_name=None)


async def _settle(sub, seq, timeout=5.0):
    deadline = time.monotonic() + timeout
    while sub.view.last_seq != seq and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_gap_is_filled_by_replay_and_view_tracks_residency(tmp_path):
    async def go():
        ctx = zmq.asyncio.Context()
        sub = KVEventSubscriber("tcp://127.0.0.1:*", "", engine_id="e0", ctx=ctx)
        sub.open()  # binds: vLLM connects to a concrete tcp endpoint
        pub = Publisher(ctx, sub.endpoint, f"ipc://{tmp_path}/replay.sock")
        sub.replay_endpoint = pub.replay_endpoint
        tasks = [asyncio.ensure_future(sub.run()), asyncio.ensure_future(pub.serve_replay())]
        try:
            await asyncio.sleep(0.3)  # slow joiner; anything lost here is replayed anyway
            expect = set()
            for i in range(30):
                hs = [i * 10 + j for j in range(4)] if i % 2 else [bytes([i, j]) * 16 for j in range(4)]
                await pub.publish([stored(hs)], drop=10 <= i < 20)
                expect.update(hs)
            gone = [5 * 10 + 1, bytes([4, 0]) * 16]
            await pub.publish([BlockRemoved(block_hashes=gone, medium="GPU")])
            expect.difference_update(gone)
            await pub.publish([LegacyStored([999], None, [1], 16, None, None)])  # older array_like event
            expect.add(999)
            await pub.publish([stored([7777], medium="CPU")])
            await _settle(sub, pub.seq - 1)
            v = sub.view
            assert v.last_seq == pub.seq - 1
            assert v.resident("GPU") == expect
            assert v.resident("CPU") == {7777}
            assert v.gaps >= 1 and v.replayed >= 10 and v.unfilled == 0 and v.bad == 0
            await pub.publish([AllBlocksCleared()])
            await _settle(sub, pub.seq - 1)
            assert v.resident("GPU") == set() and v.resident("CPU") == {7777}
            d = v.describe()
            assert d["blocks"] == {"GPU": 0, "CPU": 1} and d["cleared"] == 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pub.close()
            ctx.term()

    asyncio.run(go())


def test_gap_without_replay_is_counted_and_bad_frames_are_skipped():
    async def go():
        sub = KVEventSubscriber("inproc://x", mode="connect")
        enc = msgspec.msgpack.Encoder()
        batch = lambda hs: enc.encode(EventBatch(ts=0.0, events=[stored(hs)]))  # noqa: E731
        await sub.handle([b"", (0).to_bytes(8, "big"), batch([1])])
        await sub.handle([b"", (3).to_bytes(8, "big"), batch([2])])  # 1, 2 lost
        await sub.handle([b"", (3).to_bytes(8, "big"), batch([3])])  # duplicate: ignored
        await sub.handle([b"", b"short", batch([4])])
        await sub.handle([b"", (4).to_bytes(8, "big"), b"\xc1not msgpack"])
        await sub.handle([b"", (5).to_bytes(8, "big"), enc.encode([0.0, [["Unknown", 1], {"type": "BlockRemoved"}]])])
        v = sub.view
        assert v.resident() == {1, 2} and v.gaps == 1 and v.unfilled == 2 and v.last_seq == 5
        assert v.bad == 4
        # The publisher restarted: seq 0 again means a fresh cache.
        await sub.handle([b"", (0).to_bytes(8, "big"), batch([9])])
        assert v.resident() == {9} and v.restarts == 1

    asyncio.run(go())


def test_ingest_many_batches():
    """20,000 batches are all applied; the rate is printed, not asserted (a loaded machine is slow)."""
    view = EngineView("bench")
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(EventBatch(ts=0.0, events=[stored([i * 64 + j for j in range(16)]) for _ in range(1)]))
                for i in range(20_000)]
    t0 = time.perf_counter()
    for buf in payloads:
        view.apply_batch(buf)
    dt = time.perf_counter() - t0
    rate = len(payloads) / dt
    print(f"\nkv-event ingest: {rate:,.0f} batches/s ({rate * 16:,.0f} block hashes/s)")
    assert len(view.resident()) == 20_000 * 16


@pytest.mark.parametrize("endpoint,mode,actual", [
    ("tcp://127.0.0.1:5999", "bind", "tcp://127.0.0.1:5999"),
    ("ipc:///tmp/x", "connect", "ipc:///tmp/x"),
    ("tcp://*:5999", "connect", "tcp://127.0.0.1:5999"),  # vLLM binds wildcards; we reach it on loopback
])
def test_auto_mode_complements_vllm(endpoint, mode, actual):
    sub = KVEventSubscriber(endpoint, mode="auto")
    assert (sub.mode, sub.endpoint) == (mode, actual)
