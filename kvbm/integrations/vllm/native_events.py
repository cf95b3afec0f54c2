"""Which chunks the kvbm tier announced to vLLM's KV-event stream are gone from the daemon: its block events.

The tier announces a chunk (BlockStored) when the daemon committed it. The daemon publishes every tier change
it makes on its events socket (``daemon.events_endpoint``: ``BlocksStored``/``BlocksRemoved`` per tier); this
thread follows the tiers holding each announced chunk and hands back the chunks that left the last one (a
G2 eviction with no lower tier, an eviction from G3, ``kvbm purge``), for a BlockRemoved event. Beyond
``max_tracked`` chunks the oldest are no longer followed and reported removed at once.

A subscriber that joined late, or a daemon that published nothing (events off, or a daemon with tenants and
no CURVE, whose stream is the operator's), only means fewer removals are reported, never a wrong store.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import zmq

from kvbm import protocol as p

log = logging.getLogger("kvbm.vllm")
FIRST_TIER = "G2"  # where the daemon commits a worker's store


class RemovalWatch:
    """Follows the daemon's block events for ``namespace``; :meth:`take` returns announced keys now gone."""

    def __init__(self, endpoint: str, namespace: str, *, curve_server_key: str = "",
                 curve_keypair: tuple[bytes, bytes] | None = None, max_tracked: int = 1 << 20) -> None:
        self.endpoint, self.namespace, self.max_tracked = endpoint, namespace, max_tracked
        self._lock = threading.Lock()
        self._announced: OrderedDict[bytes, tuple[Any, set[str]]] = OrderedDict()  # hash -> (key, tiers)
        self._seen: OrderedDict[bytes, set[str]] = OrderedDict()  # tiers of hashes not announced (yet)
        self._gone: list[Any] = []
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve_server_key:
            pub, sec = curve_keypair or zmq.curve_keypair()
            self._sock.curve_serverkey = curve_server_key.encode()
            self._sock.curve_publickey, self._sock.curve_secretkey = pub, sec
        self._sock.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
        self._sock.connect(endpoint)  # a socket nobody binds yet is fine: ZeroMQ connects when it appears
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbm-native-events", daemon=True)
        self._thread.start()

    def announce(self, pairs: list[tuple[bytes, Any]]) -> None:
        """``(kvbm hash, vLLM key)`` of chunks just announced as stored (the daemon committed them to G2)."""
        with self._lock:
            for h, key in pairs:
                tiers = self._seen.pop(h, None)
                self._announced[h] = (key, tiers if tiers else {FIRST_TIER})
                self._announced.move_to_end(h)
            while len(self._announced) > self.max_tracked:
                # No longer followed: reported removed (a router then does not count on it; vLLM's event
                # tracker keeps no metadata waiting for a removal that would never come).
                self._gone.append(self._announced.popitem(last=False)[1][0])

    def take(self) -> list[Any]:
        """The announced keys that left every daemon tier since the last call."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            try:
                batch = p.decode_events(frames[2])
            except p.ProtocolError:
                continue
            self._apply(batch)

    def _apply(self, batch: p.EventBatch) -> None:
        with self._lock:
            for ev in batch.events:
                if ev.namespace != self.namespace or isinstance(ev, p.BlocksOnboarded):
                    continue
                stored = isinstance(ev, p.BlocksStored)
                for h in ev.hashes:
                    entry = self._announced.get(h)
                    if entry is None:
                        tiers = self._seen.setdefault(h, set())
                        (tiers.add if stored else tiers.discard)(ev.tier)
                        if len(self._seen) > self.max_tracked:
                            self._seen.popitem(last=False)
                        continue
                    key, tiers = entry
                    if stored:
                        tiers.add(ev.tier)
                        continue
                    tiers.discard(ev.tier)
                    if not tiers:
                        del self._announced[h]
                        self._gone.append(key)
