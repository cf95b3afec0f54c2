"""Router events: the blocks this node holds, per tier, as vLLM's KV events, for KV-aware routers.

A router that indexes vLLM engines' KV events (llm-d's KV cache manager, Dynamo's router) learns from them which
engine holds which prefix. kvbm's G2 host, G3 disk and G4 object tiers hold far more than an engine's GPU, and were
invisible to such a router; this publisher makes them a stream in exactly the format of vLLM 0.32's
``vllm.distributed.kv_events``: three frames per batch on a ZeroMQ PUB socket (``topic``, an 8-byte big-endian
sequence number from 0, a msgpack ``KVEventBatch``), and optionally its replay socket (a ROUTER: a request
``[b"", start_seq]`` is answered ``[b"", topic, seq, payload]`` per buffered batch, then ``[b"", b"", -1, b""]``).

What it says, per kvbm block (see docs/fleet.md, "Routers"): ``BlockStored`` with ``block_hashes=[kvbm hash]``,
no parent, no token ids, ``block_size=0`` (the daemon never sees tokens: this is vLLM's own placeholder event for
an offloaded block it has no token metadata for); ``BlockRemoved`` when the block leaves that tier; the tier as
``medium``/``locality``/``ownership`` (:data:`TIER_KINDS`). Under kvbm's vLLM connector and native tier a kvbm key
*is* vLLM's block hash of the block's last vLLM block, so a router matching vLLM's hashes finds it.

The first batches after binding state everything already held (``AllBlocksCleared``, then every block of every
tier): a router that replays from 0 starts from the truth. Fed by the registry's listener (the manager's one
record of which tier holds which block), so every store, write-through, demotion, eviction and purge is heard,
including G4 blocks learned from peers and the bucket (this node can load them too).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvbm.blocks import BlockKey
from kvbm.config.schema import DaemonConfig, RouterEventsConfig
from kvbm.errors import ConfigError
from kvbm.index.registry import Registry
from kvbm.security import UNIX_PATH_MAX, ipc_path, is_local_endpoint

log = logging.getLogger(__name__)

# kvbm tier kind -> (medium, locality) as vLLM's own offloading tiers publish them (CPU for host memory, STORAGE
# for its file-system and object tiers); ownership ("kvbm/<tier>") tells G3 from G4. G1 is the engine's own GPU
# cache, published by the engine.
TIER_KINDS: dict[str, tuple[str, str]] = {"host": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"),
                                          "s3": ("STORAGE", "REMOTE")}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_CHUNK = 4096  # blocks per batch of the first state
REPLAY_MAX_BYTES = 256 << 20  # the replay buffer's payloads at most (oldest batches leave first), whatever buffer_steps


# The wire structs of vllm.distributed.kv_events (0.32), field for field: tagged maps inside an array_like batch.
# Declared here because the daemon does not import vLLM; tests decode them with vLLM's own classes.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class RouterEventStats(msgspec.Struct):
    batches: int = 0
    stored: int = 0  # BlockStored events (one per block and tier)
    removed: int = 0  # blocks named in BlockRemoved events
    dropped: int = 0  # batches the PUB socket refused (its high-water mark)
    replays: int = 0  # replay requests answered


def check_bind(rc: RouterEventsConfig, dc: DaemonConfig) -> None:
    """Refuse a stream that would leak: events name block hashes (functions of the prompts served) and vLLM's format
    has no authentication, so not on a daemon with tenants, and off this host only when explicitly allowed."""
    if rc.endpoint and dc.tenants:
        raise ConfigError("router_events.endpoint: a daemon with tenants cannot publish router events (the stream "
                          "is unauthenticated and names every tenant's block hashes)")
    for field, ep in (("endpoint", rc.endpoint), ("replay_endpoint", rc.replay_endpoint)):
        if len(ipc_path(ep).encode()) > UNIX_PATH_MAX:
            raise ConfigError(f"router_events.{field} {ep}: an ipc:// path is at most {UNIX_PATH_MAX} bytes (a unix "
                              "socket's); use a shorter directory")
        if ep and not dc.allow_insecure_tcp and not is_local_endpoint(ep):
            raise ConfigError(f"router_events.{field} {ep} is reachable from other hosts and the stream is "
                              "unauthenticated (vLLM's format): bind loopback or ipc://, or set "
                              "daemon.allow_insecure_tcp: true")


class RouterEventPublisher:
    """Turns the registry's changes into vLLM ``KVEventBatch`` messages, one batch per event-loop turn."""

    def __init__(self, rc: RouterEventsConfig, registry: Registry, tier_kinds: dict[str, str]) -> None:
        self.rc = rc
        self.registry = registry
        # tier name -> (medium, locality, ownership); tiers of other kinds (G1) are not published
        self.media = {t: (*TIER_KINDS[k], f"kvbm/{t}") for t, k in tier_kinds.items() if k in TIER_KINDS}
        self.namespaces = frozenset(rc.namespaces)
        self.stats = RouterEventStats()
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._topic = rc.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0  # bytes of the payloads in _buffer
        self._encode = msgspec.msgpack.Encoder().encode
        self._lock = threading.Lock()  # the registry may call from a thread
        self._pending: dict[tuple[str, str], list[bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    def bind(self, ctx: zmq.asyncio.Context, spawn: Callable[[Any], asyncio.Task[Any]]) -> None:
        """Bind the PUB (and replay) socket, publish every block held now, then every change."""
        self._loop = asyncio.get_running_loop()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = _bind(pub, self.rc.endpoint)
        self._pub = pub
        if self.rc.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, self.rc.replay_endpoint)
            spawn(self._serve_replay())
        self.registry.listeners.append(self.on_registry)
        self._publish([AllBlocksCleared()])
        for tier in self.media:
            held = self._hashes(self.registry.keys(tier))
            for i in range(0, len(held), SNAPSHOT_CHUNK):
                self._publish(self._stored(tier, held[i : i + SNAPSHOT_CHUNK]))

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._pub = self._replay = None

    def describe(self) -> dict[str, Any]:
        """What ``kvbm status`` shows: where the stream is and what it carried."""
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "seq": self._seq,
                **msgspec.structs.asdict(self.stats)}

    # -- the registry's changes -------------------------------------------------------------------------
    def on_registry(self, kind: str, tier: str, keys: list[BlockKey]) -> None:
        if self._pub is None or tier not in self.media:
            return
        hashes = self._hashes(keys)
        if not hashes:
            return
        with self._lock:
            self._pending.setdefault((kind, tier), []).extend(hashes)
            if self._scheduled:
                return
            self._scheduled = True
        assert self._loop is not None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._loop.call_soon(self._flush)
        else:
            self._loop.call_soon_threadsafe(self._flush)

    def _hashes(self, keys: Iterable[BlockKey]) -> list[bytes]:
        ns = self.namespaces
        return [k.hash for k in keys if not ns or k.namespace in ns]

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, {}, False
        events: list[Any] = []
        for (kind, tier), hashes in pending.items():
            if kind == "stored":
                events += self._stored(tier, hashes)
            else:
                medium, locality, owner = self.media[tier]
                events.append(BlockRemoved(block_hashes=list(map(self._wire, hashes)), medium=medium,
                                           locality=locality, ownership=owner))
                self.stats.removed += len(hashes)
        if events:
            self._publish(events)

    def _stored(self, tier: str, hashes: Sequence[bytes]) -> list[Any]:
        """One event per block, as vLLM's own placeholder: a list of hashes in one event would read as a chain."""
        medium, locality, owner = self.media[tier]
        self.stats.stored += len(hashes)
        return [BlockStored(block_hashes=[self._wire(h)], parent_block_hash=None, token_ids=[], block_size=0,
                            lora_id=None, medium=medium, lora_name=None, locality=locality, ownership=owner)
                for h in hashes]

    def _wire(self, h: bytes) -> bytes | int:
        return int.from_bytes(h, "big") & ((1 << 64) - 1) if self.rc.int_hashes else h

    def _publish(self, events: list[Any]) -> None:
        if self._pub is None:
            return
        payload = self._encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))  # kept even when the PUB socket drops it: a replay fills the gap
        self._buffered += len(payload)
        while len(self._buffer) > self.rc.buffer_steps or self._buffered > REPLAY_MAX_BYTES:
            self._buffered -= len(self._buffer.popleft()[1])
        self.stats.batches += 1
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats.dropped += 1

    async def _serve_replay(self) -> None:
        """vLLM's replay protocol: every buffered batch from the asked sequence number, then the end marker."""
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("router events: replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])
            self.stats.replays += 1


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind (an ipc:// directory is created 0700); the bound endpoint (tcp port 0 resolved)."""
    if endpoint.startswith("ipc://"):
        Path(endpoint[len("ipc://") :]).absolute().parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
