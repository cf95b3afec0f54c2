"""The block-event publisher: the daemon's PUB socket (topic ``kvbm``).

Every tier change the manager makes (stores, cascades, evictions, demotions) becomes an event, batched per
event-loop turn; what the daemon *learned* of a shared tier (a peer's event, a bucket probe) is not
republished, so fleet daemons following each other do not echo.

Who may subscribe: on a daemon without tenants, whoever may connect (the ipc:// directory's user, or CURVE's
allow-list). A PUB socket cannot filter per subscriber, and events name namespaces and block hashes (functions
of the tokens served: a tenant could test whether a prompt was served), so on a daemon with tenants the stream
is the operator's, CURVE or not (:mod:`kvbm.daemon.zap`): without CURVE a subscriber authenticates with ZeroMQ
PLAIN, user ``admin`` and the admin token as password (:data:`EVENTS_USER`); with CURVE only the keys of
``daemon.curve_admin_clients_dir`` (and the daemon's own, a fleet sharing one key pair) pass, not the whole
``curve_clients_dir``. A tenant's process that reaches the socket gets nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import curve_server
from kvbm.daemon.zap import EVENTS_DOMAIN, EVENTS_USER, Zap
from kvbm.fleet.p2p import HELLO_TOPIC
from kvbm.manager.core import BlockManager
from kvbm.security import prepare_ipc

__all__ = ["EVENTS_DOMAIN", "EVENTS_USER", "EventPublisher"]


class EventPublisher:
    """Batches the manager's registry changes into :class:`~kvbm.protocol.EventBatch` messages."""

    def __init__(self, manager: BlockManager, stats: DaemonStats, shared: str) -> None:
        self.manager = manager
        self.stats = stats
        self.shared = shared  # the shared (S3) tier's name, "" without one
        self.endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._seq = 0
        self._pending: dict[tuple[str, str, str, int], list[bytes]] = {}
        self._flush_scheduled = False
        self._learning = False  # applying what others did: not this daemon's own change, not republished

    def bind(self, ctx: zmq.asyncio.Context, endpoint: str, public: str, secret: str, *, zap: Zap,
             admin_token: str = "", admin_keys: set[bytes] | frozenset[bytes] = frozenset()) -> None:
        """Bind ``endpoint`` with the request socket's CURVE keys. Given ``admin_token`` (a daemon with tenants)
        only the operator subscribes: with CURVE the public keys ``admin_keys`` and the daemon's own, without
        it PLAIN that only the admin token passes."""
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        curve_server(pub, public, secret)  # block events name namespaces and hashes: same protection
        if admin_token:
            pub.zap_domain = EVENTS_DOMAIN.encode()
            if secret:
                zap.curve(EVENTS_DOMAIN, {*admin_keys, public.encode()})
            else:
                zap.plain(EVENTS_DOMAIN, {EVENTS_USER: admin_token})
                pub.plain_server = True
        prepare_ipc(endpoint, "events_endpoint")
        pub.bind(endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        self.manager.registry.listeners.append(self.on_registry)

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close(0)

    @contextlib.contextmanager
    def learned(self) -> Iterator[None]:
        """Changes made inside are another node's (not published)."""
        self._learning = True
        try:
            yield
        finally:
            self._learning = False

    def on_registry(self, kind: str, tier: str, keys: list[BlockKey]) -> None:
        if self._pub is None or (self._learning and tier == self.shared):
            return
        pending = self._pending
        if kind == "stored":  # stored blocks carry their size, so a peer indexes them without asking the bucket
            sizes = list(map(self.manager.by_name[tier].nbytes, keys))
            ns = keys[0].namespace
            if sizes.count(sizes[0]) == len(keys) and all(k.namespace == ns for k in keys):  # the usual batch
                pending.setdefault((kind, tier, ns, sizes[0] or 0), []).extend(k.hash for k in keys)
            else:
                for key, size in zip(keys, sizes, strict=True):
                    pending.setdefault((kind, tier, key.namespace, size or 0), []).append(key.hash)
        else:
            for key in keys:
                pending.setdefault((kind, tier, key.namespace, 0), []).append(key.hash)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        events: list[Any] = []
        for (kind, tier, ns, nbytes), hashes in pending.items():
            cls = p.BlocksStored if kind == "stored" else p.BlocksRemoved
            events.append(cls(namespace=ns, hashes=hashes, tier=tier, nbytes=nbytes))
        if events:
            self.publish(*events)

    def hello(self, payload: bytes) -> None:
        """Announce this daemon's peer-read socket (:class:`kvbm.fleet.p2p.Hello`) to its followers."""
        if self._pub is None:
            return
        try:
            self._pub.send_multipart([HELLO_TOPIC, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.stats.dropped += 1

    def publish(self, *events: Any) -> None:
        if self._pub is None:
            return
        buf = p.encode(p.EventBatch(ts=time.time(), events=list(events)), 1 << 62)
        try:
            self._pub.send_multipart([p.EVENTS_TOPIC, self._seq.to_bytes(8, "big"), buf], flags=zmq.NOBLOCK)
            self._seq += 1
            self.stats.events_published += 1
        except zmq.ZMQError:
            self.stats.dropped += 1
