"""Subscriber for vLLM's KV-cache event stream: which blocks each engine holds right now.

vLLM's ``ZmqEventPublisher`` sends three frames per batch on a PUB socket: ``topic``, an 8-byte
big-endian sequence number, and a msgpack ``KVEventBatch``. Its structs are ``array_like`` and tagged,
so a batch is ``[ts, [event, ...], data_parallel_rank?]`` and an event is a list whose first item is
its tag: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
...]``, ``["BlockRemoved", block_hashes, medium, ...]`` or ``["AllBlocksCleared"]`` (see below). Hashes are ints
or bytes. Decoding here is positional and tolerant: trailing fields a newer vLLM adds are ignored.

Since vLLM 0.32 (checked against its ``distributed/kv_events.py``) events are tagged maps
(``{"type": "BlockStored", "block_hashes": ..., "medium": ...}``) inside the array_like batch; older
releases encoded them array_like too. Both forms are read.

A gap in sequence numbers is filled from the engine's replay endpoint (a ROUTER): we send
``[b"", start_seq(8 bytes)]`` and it answers ``[b"", topic, seq, payload]`` per buffered batch, then
``[b"", b"", seq=-1, b""]`` (older releases: without the topic frame). A subscriber that joins late
replays from 0 first. vLLM binds its publisher for ``ipc://`` and wildcard endpoints and connects
otherwise, so for a concrete ``tcp://`` endpoint the subscriber binds (``mode="auto"``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ = -1
MEDIUM_GPU = "GPU"


def block_hash_key(h: Any) -> bytes | int:
    """A hashable, comparable form of a vLLM block hash (int or bytes; lists become bytes)."""
    if isinstance(h, (bytes, int)):
        return h
    if isinstance(h, (bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, (list, tuple)):
        return msgspec.msgpack.encode(h)
    raise ValueError(f"unsupported block hash {h!r}")


class EngineView:
    """The resident block hashes of one engine, per medium, kept from its event stream."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.blocks: dict[str, set[bytes | int]] = {}
        self.last_seq: int | None = None
        self.events = 0
        self.batches = 0
        self.gaps = 0
        self.replayed = 0
        self.unfilled = 0
        self.bad = 0
        self.cleared = 0
        self.restarts = 0
        self.last_ts = 0.0

    def resident(self, medium: str = MEDIUM_GPU) -> set[bytes | int]:
        return self.blocks.setdefault(medium, set())

    def apply_batch(self, payload: bytes | memoryview) -> int:
        """Apply one msgpack KVEventBatch; returns events applied. Raises ValueError if unreadable."""
        try:
            batch = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError as e:
            raise ValueError(f"not msgpack: {e}") from None
        if isinstance(batch, dict):  # a non-array_like encoder
            ts, events = batch.get("ts", 0.0), batch.get("events")
        elif isinstance(batch, list) and len(batch) >= 2:
            ts, events = batch[0], batch[1]
        else:
            raise ValueError("event batch is not [ts, events, ...]")
        if not isinstance(events, list):
            raise ValueError("event batch has no event list")
        self.batches += 1
        self.last_ts = float(ts) if isinstance(ts, (int, float)) else self.last_ts
        n = 0
        for ev in events:
            try:
                self._apply(ev)
                n += 1
            except (ValueError, TypeError, IndexError, KeyError) as e:
                self.bad += 1
                log.debug("engine %s: bad event %r: %s", self.engine_id, ev, e)
        self.events += n
        return n

    def _apply(self, ev: Any) -> None:
        if isinstance(ev, dict):
            tag = ev.get("type")
            fields = ev
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            tag = ev[0]
            fields = None
        else:
            raise ValueError("event without a tag")
        if tag == "BlockStored":
            hashes = fields["block_hashes"] if fields else ev[1]
            medium = (fields.get("medium") if fields else (ev[6] if len(ev) > 6 else None)) or MEDIUM_GPU
            self.resident(medium).update(block_hash_key(h) for h in hashes)
        elif tag == "BlockRemoved":
            hashes = fields["block_hashes"] if fields else ev[1]
            medium = (fields.get("medium") if fields else (ev[2] if len(ev) > 2 else None)) or MEDIUM_GPU
            self.resident(medium).difference_update(block_hash_key(h) for h in hashes)
        elif tag == "AllBlocksCleared":
            # vLLM clears its GPU prefix cache; other media (its own CPU offload) keep theirs.
            self.resident(MEDIUM_GPU).clear()
            self.cleared += 1
        else:
            raise ValueError(f"unknown event {tag!r}")

    def describe(self) -> dict[str, object]:
        return {
            "blocks": {m: len(s) for m, s in self.blocks.items()},
            "last_seq": self.last_seq,
            "batches": self.batches,
            "events": self.events,
            "gaps": self.gaps,
            "replayed": self.replayed,
            "unfilled": self.unfilled,
            "bad": self.bad,
            "cleared": self.cleared,
            "restarts": self.restarts,
        }


class KVEventSubscriber:
    """Follows one vLLM engine's KV-event stream (SUB) and keeps an :class:`EngineView` of it."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        engine_id: str = "",
        topic: bytes = b"",
        mode: str = "auto",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        """``mode``: "bind", "connect" or "auto" (bind tcp, connect ipc/inproc and vLLM's wildcard binds)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.view = EngineView(engine_id or endpoint)
        self.topic = topic
        host_wildcard = endpoint.startswith(("tcp://*", "tcp://[::]", "tcp://0.0.0.0"))
        if mode == "auto":
            mode = "connect" if endpoint.startswith(("ipc://", "inproc://")) or host_wildcard else "bind"
        if mode == "connect" and host_wildcard:  # vLLM bound every interface: reach it on loopback
            self.endpoint = "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
        if mode not in ("bind", "connect"):
            raise ValueError(f"mode must be auto, bind or connect, not {mode!r}")
        self.mode = mode
        self.replay_timeout_s = replay_timeout_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self.ready = asyncio.Event()

    def open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.mode == "bind":
            sub.bind(self.endpoint)
            self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:* -> the real port
        else:
            sub.connect(self.endpoint)
        self._sub = sub

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None

    async def run(self) -> None:
        """Receive until cancelled."""
        if self._sub is None:
            self.open()
        assert self._sub is not None
        self.ready.set()
        try:
            while True:
                frames = await self._sub.recv_multipart()
                await self.handle(frames)
        finally:
            self.close()

    async def handle(self, frames: list[bytes]) -> None:
        """One published message: ``[topic, seq, payload]``."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.view.bad += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.view.last_seq
        if last is None and seq > 0 and self.replay_endpoint:
            # Joined late (or the first batches were lost to PUB/SUB's slow join): fetch what the
            # engine still buffers, so the view starts complete.
            self.view.last_seq = last = -1
        if last is not None:
            if seq <= last:
                if last - seq > 1_000_000 or seq == 0:  # the publisher restarted: its cache is new too
                    self.view.restarts += 1
                    for s in self.view.blocks.values():
                        s.clear()
                else:
                    return  # a duplicate (e.g. already replayed)
            elif seq > last + 1:
                self.view.gaps += 1
                await self._fill(last + 1, seq)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.view.apply_batch(payload)
        except ValueError as e:
            self.view.bad += 1
            log.warning("engine %s: undecodable batch %d: %s", self.view.engine_id, seq, e)
        self.view.last_seq = seq

    async def _fill(self, start: int, stop: int) -> None:
        """Replay batches ``start .. stop-1`` from the engine; counts what could not be had."""
        got = 0
        if self.replay_endpoint:
            try:
                for seq, payload in await self.replay(start):
                    if seq >= stop:
                        break
                    if seq == self.view.last_seq + 1:  # type: ignore[operator]
                        self._apply(seq, payload)
                        got += 1
            except (TimeoutError, zmq.ZMQError) as e:
                log.warning("engine %s: replay from %d failed: %s", self.view.engine_id, start, e)
        self.view.replayed += got
        if start + got < stop:
            self.view.unfilled += stop - start - got
            log.warning("engine %s: %d events lost (seq %d..%d)", self.view.engine_id, stop - start - got,
                        start + got, stop - 1)

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Ask the replay endpoint for every buffered batch from ``start`` on."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    raise TimeoutError(f"no end marker from {self.replay_endpoint}")
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM >= 0.11: [topic, seq, payload]; end: [b"", -1, b""]
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    continue
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[1]))
        finally:
            sock.close(0)


def describe_views(subs: Iterable[KVEventSubscriber]) -> dict[str, object]:
    return {s.view.engine_id: s.view.describe() for s in subs}
