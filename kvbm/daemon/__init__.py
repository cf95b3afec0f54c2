"""The kvbm daemon: serves workers over ZeroMQ and wires their requests to the BlockManager.

One ROUTER socket takes requests (see :mod:`kvbm.protocol`); each is handled in its own task so a slow
offload never holds up a lookup. Offloads are bounded: with ``max_queue`` PrepareStore/CommitStore
requests in flight a new PrepareStore is answered :class:`~kvbm.protocol.Shed`. With ``max_inflight``
requests of any kind in flight the daemon stops reading (ZeroMQ queues, then the clients time out).
Bad frames get an Error reply (or are dropped) and are counted; none stops the daemon.

Pins: blocks onboarded for a worker stay pinned in G2 until it sends Release or Unregister, or its
lease (``worker_timeout_s`` since its last request) runs out; its unfinished stores are aborted then.
Worker sessions, and the G2 slot references they hold, live in :mod:`kvbm.sessions` (see there for
the quarantine of an expired worker's slots). Slot requests carrying another G2 pool generation than
this daemon's are refused (``E_STALE``).
The daemon publishes its own block events on ``events_endpoint`` (topic ``kvbm``) and follows vLLM
KV-event streams (``vllm_events``), exposing them in Stats.

Authorization (:meth:`Daemon._authorize`, before any handler runs): a worker's token is bound to its
layout's namespace; requests naming another namespace or another engine's barrier are refused
``E_FORBIDDEN``. Evict, Reindex and Stats with resident hashes need an admin session: a Register that
carried the admin token (:mod:`kvbm.security`, created at first start). Refusals are counted in
``errors["forbidden"]``. Both sockets use the same CURVE keys and client allow-list when configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.config import Config
from kvbm.errors import KvbmError, TierFullError, TierUnavailableError
from kvbm.fleet import BucketProbe, PeerFollower
from kvbm.health import readiness
from kvbm.keys import is_namespace
from kvbm.kvevents import KVEventSubscriber, describe_views
from kvbm.manager import PERSISTENT, BlockManager
from kvbm.metrics import Metrics, MetricsServer
from kvbm.redact import redact
from kvbm.security import admin_token_path, check_binds, ensure_admin_token, server_keys, token_matches
from kvbm.sessions import Sessions, WorkerSession
from kvbm.tiers.pool import SlotPoolTier
from kvbm.tiers.s3 import S3Tier

log = logging.getLogger(__name__)

STORE_TIER = "G2"
INDEX_RETRY_S = (0.5, 10.0)  # bucket listing retries: first delay, cap (doubling in between)


class DaemonStats(msgspec.Struct):
    requests: int = 0
    replies: int = 0
    dropped: int = 0
    shed: int = 0
    offload_seconds: float = 0.0
    onboard_seconds: float = 0.0
    lookup_seconds: float = 0.0
    events_published: int = 0
    prefetches: int = 0
    prefetch_blocks: int = 0
    prefetch_skipped: int = 0
    registered: int = 0
    expired_workers: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)




def quarantine_grace_s(worker_timeout_s: float) -> float:
    """How long an expired worker's slots stay quarantined at most: it was already silent a whole
    lease; give it two more (and at least 30 s) to finish a copy it may have been stalled in."""
    return max(30.0, 2 * worker_timeout_s)


class _Handled(Exception):
    """Raised by a handler to answer with an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Daemon:
    """Binds the daemon's sockets and serves until :meth:`stop`."""

    def __init__(self, cfg: Config, manager: BlockManager, *, ctx: zmq.asyncio.Context | None = None) -> None:
        self.cfg = cfg
        self.dc = cfg.daemon
        self.manager = manager
        self.stats = DaemonStats()
        self.sessions = Sessions(manager, STORE_TIER, quarantine_grace_s(self.dc.worker_timeout_s))
        self.workers: dict[str, WorkerSession] = self.sessions.workers
        self.endpoint = self.dc.endpoint
        self.events_endpoint = self.dc.events_endpoint
        self.metrics_port: int | None = None
        self.ready = asyncio.Event()
        self._ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self._router: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._auth: Any = None
        self._admin_token = ""  # read (or created) at run(); never logged
        self._curve_keys = ("", "")  # (public, secret) Z85, read at run()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._inflight = 0
        self._offloads = 0
        self._slot_free = asyncio.Event()
        self._event_seq = 0
        self._barriers: dict[tuple[str, str], tuple[set[int], asyncio.Future[None]]] = {}
        self._subs: list[KVEventSubscriber] = []
        self._pending_events: dict[tuple[str, str, str], list[bytes]] = {}
        self._prefetching = 0
        self._bucket_indexed = asyncio.Event()
        self._bucket_index_error = ""  # why the last listing failed (until one completes)
        self._ns_retrying: set[str] = set()
        self._ns_indexed: set[str] = set()
        self._ns_locks: dict[str, asyncio.Lock] = {}
        self._flush_scheduled = False
        self._metrics: MetricsServer | None = None
        # Fleet (kvbm.fleet): what other daemons sharing the bucket store and delete.
        shared = next((t for t in manager.tiers if isinstance(t, S3Tier)), None)
        self._shared = shared.name if shared is not None else ""
        self.probe: BucketProbe | None = None
        if shared is not None and self.dc.probe:
            self.probe = BucketProbe(shared, self._learn_probed, concurrency=self.dc.probe_concurrency,
                                     max_blocks=self.dc.probe_max_blocks, negative_ttl_s=self.dc.probe_negative_ttl_s,
                                     negative_max=self.dc.probe_negative_max)
        self.peers: list[PeerFollower] = []
        self._learning = False  # applying what others did: not this daemon's own change, not republished
        # Latency histograms: observed by the handlers below, the manager's copies and the S3 tier's requests.
        self.metrics = Metrics(self.snapshot, self.readiness, [t.name for t in manager.tiers])
        manager.observe_copy = self.metrics.observe_copy
        for tier in manager.tiers:
            if tier.kind == "s3":
                tier.observe = self.metrics.observe_s3  # type: ignore[attr-defined]
        # Quick requests are answered inline by the receive loop; the others each get a task.
        self._inline: dict[type, Any] = {
            p.Unregister: self._unregister,
            p.Ping: self._ping,
            p.Release: self._release,
            p.Stats: self._stats,
        }
        self._handlers: dict[type, Any] = {
            p.Register: self._register,
            p.Lookup: self._lookup,  # a task: it may wait (probe_budget_ms) for a bucket probe
            p.PrepareStore: self._prepare,
            p.CommitStore: self._commit,
            p.Onboard: self._onboard,
            p.Barrier: self._barrier,
            p.Evict: self._evict,
            p.Reindex: self._reindex,
        }

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def g2(self) -> SlotPoolTier:
        tier = self.manager.by_name.get(STORE_TIER)
        if not isinstance(tier, SlotPoolTier):
            raise KvbmError("the daemon needs a G2 host tier (workers share its slots)")
        return tier

    def _bind(self) -> None:
        dc = self.dc
        public, secret = self._curve_keys
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # libzmq drops the connection of a peer that sends more than this; between max_message_bytes
        # and it, the daemon still answers with an Error.
        router.setsockopt(zmq.MAXMSGSIZE, 4 * dc.max_message_bytes + 1024)
        if secret:
            if not zmq.has("curve"):
                raise KvbmError("daemon CURVE keys are set but libzmq has no CURVE support")
            if dc.curve_clients_dir:  # the ZAP handler covers every socket of this context: ROUTER and PUB
                from zmq.auth.asyncio import AsyncioAuthenticator

                self._auth = AsyncioAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=dc.curve_clients_dir)
        _curve_server(router, public, secret)
        _prepare_ipc(dc.endpoint)
        router.bind(dc.endpoint)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = router
        if dc.events_endpoint:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, 10_000)
            _curve_server(pub, public, secret)  # block events name namespaces and hashes: same protection
            _prepare_ipc(dc.events_endpoint)
            pub.bind(dc.events_endpoint)
            self.events_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub = pub

    async def run(self) -> None:
        """Start the manager (re-indexing persistent tiers), bind, and serve until :meth:`stop`."""
        _ = self.g2
        s3_tiers = [t.name for t in self.manager.tiers if t.kind == "s3"]
        # Refuse an unsafe socket set-up before touching any tier (a disk index can take a while).
        self._curve_keys = server_keys(self.dc)
        check_binds(self.dc, curve=bool(self._curve_keys[1]))
        token_path = admin_token_path(self.dc)
        self._admin_token = await asyncio.to_thread(ensure_admin_token, token_path)
        # The bucket is listed apart from the other tiers: S3 being down must not stop G2/G3 serving.
        await self.manager.start(index=("device", "host", "disk"))
        if not s3_tiers:
            self._bucket_indexed.set()
        elif self.dc.index_bucket == "start":
            try:
                await self._list_bucket(s3_tiers)
            except TierUnavailableError as e:
                self._index_failed(e, INDEX_RETRY_S[0])
        self._bind()
        self.manager.registry.listeners.append(self._on_registry)
        for i, ep in enumerate(self.dc.vllm_events):
            replay = self.dc.vllm_replay[i] if i < len(self.dc.vllm_replay) else ""
            sub = KVEventSubscriber(ep, replay, mode=self.dc.vllm_events_mode, ctx=self._ctx)
            sub.open()
            self._subs.append(sub)
            self._spawn(sub.run())
        for ep in self.dc.peers:
            peer = PeerFollower(ep, self._ctx, self._apply_peer, self._peer_gap, curve=self._peer_curve())
            peer.open()
            self.peers.append(peer)
            self._spawn(peer.run())
        if self.dc.metrics_port:
            self._metrics = MetricsServer(self.metrics, self.dc.metrics_host, max(self.dc.metrics_port, 0))
            self.metrics_port = await self._metrics.start()
        self._spawn(self._reaper())
        if s3_tiers and not self._bucket_indexed.is_set() and self.dc.index_bucket != "lazy":
            self._spawn(self._index_bucket(s3_tiers))
        logj("daemon.started", endpoint=self.endpoint, events=self.events_endpoint, metrics_port=self.metrics_port,
             curve=self._router.curve_server if self._router is not None else False, admin_token_file=str(token_path),
             tiers=[t.name for t in self.manager.tiers], blocks=len(self.manager.registry), pid=os.getpid())
        self.ready.set()
        recv = asyncio.ensure_future(self._recv_loop())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and not recv.cancelled() and recv.exception() is not None:
                raise recv.exception()  # type: ignore[misc]
        finally:
            recv.cancel()
            stop.cancel()
            await self._shutdown()

    async def stop(self) -> None:
        self._stop.set()

    async def _list_bucket(self, names: list[str]) -> None:
        """List the whole bucket once (raises TierUnavailableError if it cannot be listed to the end)."""
        t0 = time.perf_counter()
        blocks = 0
        for name in names:
            blocks += await self.manager.index_tier(name)
        self._bucket_index_error = ""
        self._bucket_indexed.set()
        logj("bucket.indexed", blocks=blocks, seconds=round(time.perf_counter() - t0, 3))

    def _index_failed(self, e: Exception, retry_s: float, namespace: str = "") -> None:
        first = str(e) != self._bucket_index_error
        self._bucket_index_error = str(e)
        logj("bucket.index_failed", level=logging.WARNING if first else logging.DEBUG, error=str(e),
             namespace=namespace or None, retry_s=retry_s)

    async def _index_bucket(self, names: list[str]) -> None:
        """List the whole bucket in the background (lookups find G4 blocks as their pages arrive), retrying
        with backoff until a listing completes: until then the snapshot says ``bucket_indexed: false``."""
        delay, cap = INDEX_RETRY_S
        while not self._bucket_indexed.is_set():
            try:
                await self._list_bucket(names)
            except TierUnavailableError as e:
                self._index_failed(e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)

    async def _index_namespace(self, namespace: str) -> None:
        """Before a worker's first Registered reply: list its namespace in the bucket (once). If S3 cannot
        be listed now the worker is registered anyway and the namespace is listed later."""
        if self._bucket_indexed.is_set() or namespace in self._ns_indexed:
            return
        async with self._ns_locks.setdefault(namespace, asyncio.Lock()):
            if namespace in self._ns_indexed:
                return
            try:
                for t in self.manager.tiers:
                    if t.kind == "s3":
                        await self.manager.index_tier(t.name, namespace)
            except TierUnavailableError as e:
                self._index_failed(e, INDEX_RETRY_S[0], namespace)
                if namespace not in self._ns_retrying:
                    self._ns_retrying.add(namespace)
                    self._spawn(self._retry_namespace(namespace))
                return
            self._ns_indexed.add(namespace)
            if not self._ns_retrying - {namespace}:
                self._bucket_index_error = ""

    async def _retry_namespace(self, namespace: str) -> None:
        delay, cap = INDEX_RETRY_S
        try:
            while namespace not in self._ns_indexed and not self._bucket_indexed.is_set():
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                await self._index_namespace(namespace)
        finally:
            self._ns_retrying.discard(namespace)

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in list(self.workers.values()):
            self._drop_worker(w, "shutdown", quarantine=False)
        for sub in self._subs:
            sub.close()
        for peer in self.peers:
            peer.close()
        if self._metrics is not None:
            await self._metrics.close()
        if self._auth is not None:
            self._auth.stop()
        for s in (self._router, self._pub):
            if s is not None:
                s.close(0)
        await self.manager.drain()
        if self._own_ctx:
            self._ctx.term()
        logj("daemon.stopped", **{k: v for k, v in msgspec.structs.asdict(self.stats).items() if k != "errors"})

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- receive / dispatch ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._router is not None
        while True:
            while self._inflight >= self.dc.max_inflight:
                self._slot_free.clear()
                await self._slot_free.wait()
            frames = await self._router.recv_multipart()
            try:
                self._dispatch(frames)
            except Exception:  # never let one request take the daemon down
                log.exception("dispatch failed")
                self.stats.dropped += 1

    def _dispatch(self, frames: list[bytes]) -> None:
        self.stats.requests += 1
        if len(frames) == 2:
            ident, envelope, payload = frames[0], [], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            ident, envelope, payload = frames[0], [b""], frames[2]
        else:
            self.stats.dropped += 1
            self._count_error("frames")
            return
        route = [ident, *envelope]
        try:
            msg = p.decode_request(payload, self.dc.max_message_bytes)
        except p.ProtocolError as e:
            self._error(route, e.rid, e.code, e.message)
            return
        worker = None
        if not isinstance(msg, p.Register):
            worker = self.workers.get(msg.token)
            # Monitors (kvbm status, health checks) may read stats, and Ping without a token, unregistered. A
            # Ping with an unknown token still gets E_UNREGISTERED: that worker's lease ran out, it must register.
            monitor = isinstance(msg, p.Stats) or (isinstance(msg, p.Ping) and not msg.token)
            if worker is None and not monitor:
                self._error(route, msg.rid, p.E_UNREGISTERED, self.sessions.unknown_token(msg))
                return
            if worker is not None:
                worker.last_seen = time.monotonic()
        try:
            denied = self._authorize(msg, worker)
        except _Handled as e:
            self._error(route, msg.rid, e.code, str(e))
            return
        if denied:
            self._error(route, msg.rid, p.E_FORBIDDEN, denied)
            return
        inline = self._inline.get(type(msg))
        if inline is not None:
            try:
                reply = inline(msg, worker)
            except Exception as e:
                self._fail(route, msg, e)
            else:
                reply.rid = msg.rid
                self._send(route, reply)
            return
        offload = isinstance(msg, (p.PrepareStore, p.CommitStore))
        if isinstance(msg, p.PrepareStore) and self._offloads >= self.dc.max_queue:
            self.stats.shed += 1
            self._send(route, p.Shed(rid=msg.rid))
            return
        self._inflight += 1
        self._offloads += offload
        task = self._spawn(self._handle(route, msg, worker))
        task.add_done_callback(lambda _t: self._done(offload))

    def _authorize(self, msg: Any, w: WorkerSession | None) -> str:
        """Why this session may not make this request ("" when it may). The one place access is decided."""
        if isinstance(msg, p.Register):
            if msg.admin_token and not token_matches(msg.admin_token, self._admin_token):
                return "wrong admin token"
            return ""
        if w is not None and w.admin:
            return self._check_names(msg)
        need = "needs an admin session (Register with the token of daemon.admin_token_file)"
        if isinstance(msg, (p.Evict, p.Reindex)):
            return f"{type(msg).__name__} {need}"
        if isinstance(msg, p.Stats) and msg.resident:
            return f"Stats with resident block hashes {need}"
        if w is None:
            return ""  # an unregistered monitor's Stats or Ping
        if isinstance(msg, p._Blocks) and msg.namespace != w.namespace:
            return (f"namespace {msg.namespace!r} is not this worker's: a token serves its own layout's namespace "
                    f"(other namespaces need an admin session, the token of daemon.admin_token_file)")
        if isinstance(msg, p.Barrier) and msg.engine_id != w.engine_id:
            return f"engine {msg.engine_id!r} is not this worker's"
        return ""

    @staticmethod
    def _check_names(msg: Any) -> str:
        """An admin may name any namespace, but only a well-formed one (it becomes file and object names)."""
        ns = getattr(msg, "namespace", "")
        if ns and not is_namespace(ns):
            raise _Handled(p.E_BAD_REQUEST, f"{ns!r} is not a kvbm namespace")
        return ""

    def _done(self, offload: bool) -> None:
        self._inflight -= 1
        self._offloads -= offload
        self._slot_free.set()

    async def _handle(self, route: list[bytes], msg: Any, worker: WorkerSession | None) -> None:
        try:
            reply = await self._handlers[type(msg)](msg, worker)
        except Exception as e:
            self._fail(route, msg, e)
            return
        reply.rid = msg.rid
        self._send(route, reply)

    def _fail(self, route: list[bytes], msg: Any, e: Exception) -> None:
        if isinstance(e, _Handled):
            code = e.code
        elif isinstance(e, TierFullError):
            code = p.E_FULL
        elif isinstance(e, (KvbmError, ValueError)):
            code = p.E_BAD_REQUEST
        else:
            log.exception("%s failed", type(msg).__name__, exc_info=e)
            code = p.E_INTERNAL
        self._error(route, msg.rid, code, str(e) if code != p.E_INTERNAL else f"{type(e).__name__}: {e}")

    def _send(self, route: list[bytes], msg: Any) -> None:
        assert self._router is not None
        try:
            buf = p.encode(msg, self.dc.max_message_bytes)
        except p.ProtocolError as e:
            buf = p.encode(p.Error(rid=msg.rid, code=e.code, message=e.message))
        try:
            self._router.send_multipart([*route, buf], flags=zmq.NOBLOCK)
            self.stats.replies += 1
        except zmq.ZMQError as e:  # peer gone / HWM: the reply is lost, the client times out
            self.stats.dropped += 1
            log.debug("reply dropped: %s", e)

    def _error(self, route: list[bytes], rid: int, code: str, message: str) -> None:
        self._count_error(code)
        logj("request.error", code=code, rid=rid, message=message[:200], level=logging.DEBUG)
        self._send(route, p.Error(rid=rid, code=code, message=message))

    def _count_error(self, code: str) -> None:
        self.stats.errors[code] = self.stats.errors.get(code, 0) + 1

    # -- handlers -------------------------------------------------------------------------------------
    async def _register(self, msg: p.Register, _w: None) -> p.Registered:
        g2 = self.g2
        layout = msg.layout
        if layout.block_nbytes > g2.slot_bytes:
            raise _Handled(p.E_BAD_REQUEST, f"layout blocks are {layout.block_nbytes} B; G2 slots {g2.slot_bytes} B")
        if not 0 <= msg.tp_rank < max(msg.tp_size, 1):
            raise _Handled(p.E_BAD_REQUEST, f"tp_rank {msg.tp_rank} outside [0, {msg.tp_size})")
        for name in ("model", "backend", "revision", "dtype"):
            if len(getattr(layout, name)) > p.MAX_STR:
                raise _Handled(p.E_LIMIT, f"layout.{name} is longer than {p.MAX_STR} characters")
        await self._index_namespace(layout.namespace)
        for old in self.sessions.by_worker_id(msg.worker_id):
            self._drop_worker(old, "re-registered")
        token = secrets.token_hex(16)
        admin = bool(msg.admin_token)  # checked by _authorize
        self.sessions.add(token, msg, admin=admin)
        self.stats.registered += 1
        logj("worker.registered", worker=msg.worker_id, engine=msg.engine_id, rank=msg.tp_rank,
             namespace=layout.namespace, admin=admin)
        return p.Registered(
            token=token, namespace=layout.namespace, shm_name=getattr(g2, "shm_name", ""), generation=self._generation,
            slot_bytes=g2.slot_bytes, num_slots=g2.num_slots, capacity_bytes=g2.capacity_bytes,
            block_nbytes=layout.block_nbytes,
        )

    @property
    def _generation(self) -> str:
        return getattr(self.g2, "generation", "")

    def _check_generation(self, msg: p._SlotReq) -> None:
        if msg.generation != self._generation:
            raise _Handled(p.E_STALE, f"G2 pool generation {msg.generation!r} is not this daemon's "
                                      f"({self._generation!r}): register again and map the new pool")

    def _unregister(self, _msg: p.Unregister, w: WorkerSession) -> p.Released:
        return p.Released(count=self._drop_worker(w, "unregistered", quarantine=False))

    def _ping(self, _msg: p.Ping, _w: WorkerSession) -> p.Pong:
        return p.Pong()

    async def _lookup(self, msg: p.Lookup, _w: WorkerSession) -> p.LookupReply:
        """The fastest tier of each block of the leading run held anywhere. A run that ends short of the request
        while G4 is enabled starts a bucket probe of the next blocks (another node may have stored them); the
        reply waits for it up to ``probe_budget_ms``: a probe done by then is in this reply, a slower one fills
        the index for the next lookup (and starts the prefetch of what it found)."""
        t0 = time.perf_counter()
        keys = msg.keys()
        tiers = self.manager.lookup(keys)
        if len(tiers) < len(keys) and self.probe is not None:
            probe = self.probe.start(keys[len(tiers) :])
            if probe is not None:
                if self.dc.probe_budget_ms > 0:
                    await asyncio.wait({probe}, timeout=self.dc.probe_budget_ms / 1000)
                if probe.done():
                    tiers = self.manager.relookup(keys, tiers)
                else:
                    self.probe.stats.late += 1
                    if self.dc.prefetch:
                        probe.add_done_callback(lambda _t: self._prefetch_run(keys))
        self.stats.lookup_seconds += time.perf_counter() - t0
        self.metrics.lookup.labels(tier=self.metrics.slowest(tiers)).observe(time.perf_counter() - t0)
        if self.dc.prefetch and any(t not in ("G1", STORE_TIER) for t in tiers):
            self._prefetch(keys[: len(tiers)])
        return p.LookupReply(matched=len(tiers), tiers=tiers)

    def _prefetch_run(self, keys: list[BlockKey]) -> None:
        """Prefetch the leading run of ``keys`` if part of it is on a slow tier (after a late probe)."""
        tiers = self.manager.registry.match_prefix(keys)
        if any(t not in ("G1", STORE_TIER) for t in tiers):
            self._prefetch(keys[: len(tiers)])

    def _prefetch(self, keys: list[BlockKey]) -> None:
        """A lookup that hits disk or S3 is usually followed by an Onboard: start bringing the blocks up to
        G2 now, in the background, so the Onboard finds them there (or joins the copy in flight)."""
        if self._prefetching >= self.dc.max_prefetch:
            self.stats.prefetch_skipped += 1
            return
        self._prefetching += 1

        async def run() -> None:
            try:
                self.stats.prefetch_blocks += await self.manager.onboard(keys, to=STORE_TIER)
            except Exception as e:  # a prefetch is a hint; the Onboard that follows reports real errors
                log.debug("prefetch failed: %s", e)
            finally:
                self._prefetching -= 1

        self.stats.prefetches += 1
        self._spawn(run())

    def _check_store(self, msg: p.PrepareStore | p.CommitStore, w: WorkerSession) -> None:
        # Even an admin session stores only its own layout's blocks: the slot size is the layout's.
        if msg.namespace != w.namespace:
            raise _Handled(p.E_FORBIDDEN, f"namespace {msg.namespace!r} is not this worker's ({w.namespace!r})")

    async def _prepare(self, msg: p.PrepareStore, w: WorkerSession) -> p.Slots:
        self._check_store(msg, w)
        self._check_generation(msg)
        if not 0 < msg.nbytes <= self.g2.slot_bytes:
            raise _Handled(p.E_BAD_REQUEST, f"nbytes {msg.nbytes} outside (0, {self.g2.slot_bytes}]")
        t0 = time.perf_counter()
        keys = msg.keys()
        try:
            slots = await self.manager.prepare_store(keys, msg.nbytes, STORE_TIER)
        finally:
            self.stats.offload_seconds += time.perf_counter() - t0
            self.metrics.store.labels(op="prepare").observe(time.perf_counter() - t0)
        if not self.sessions.alive(w):  # dropped while we waited (nothing copied yet): give the slots back
            self.manager.complete_store([k for k, s in zip(keys, slots, strict=True) if s is not None], ok=False)
            raise _Handled(p.E_UNREGISTERED, "worker left")
        self.sessions.prepared(w, keys, slots)
        return p.Slots(slots=slots)

    async def _commit(self, msg: p.CommitStore, w: WorkerSession) -> p.Ack:
        self._check_store(msg, w)
        self._check_generation(msg)
        t0 = time.perf_counter()
        keys = msg.keys()
        mine = self.sessions.take_prepared(w, keys)
        stored = self.manager.complete_store(mine, msg.ok, cascade=not msg.durable)
        durable = 0
        try:
            if msg.ok and msg.durable:
                held = [k for k in keys if self.manager.where(k)]
                durable = await self.manager.offload(held, durable=True)
        finally:
            self.stats.offload_seconds += time.perf_counter() - t0
            op = "commit_durable" if msg.ok and msg.durable else "commit"
            self.metrics.store.labels(op=op).observe(time.perf_counter() - t0)
        return p.Ack(stored=stored, durable=durable)

    async def _onboard(self, msg: p.Onboard, w: WorkerSession) -> p.Onboarded:
        self._check_generation(msg)
        t0 = time.perf_counter()
        keys = msg.keys()
        reg = self.manager.registry
        reg.pin(keys)  # before the await, so nothing we bring up is evicted before the worker reads it
        source = self.metrics.slowest(reg.match_prefix(keys))  # the tier the onboard's latency comes from
        try:
            n = await self.manager.onboard(keys, to=STORE_TIER)
        except BaseException:
            reg.unpin(keys)
            raise
        g2 = self.g2
        held: list[tuple[BlockKey, int]] = []
        nbytes: list[int] = []
        for k in keys[:n]:
            got = g2.acquire(k)  # the worker's reference on this very slot, until it releases it
            if got is None:
                break
            held.append((k, got[0]))
            nbytes.append(got[1])
        n = len(held)
        reg.unpin(keys[n:])
        if self.sessions.alive(w):
            self.sessions.pin(w, held)
        else:
            reg.unpin(keys[:n])
            for _k, slot in held:
                g2.unref(slot)
            n, held, nbytes = 0, [], []
        slots = [slot for _k, slot in held]
        self.stats.onboard_seconds += time.perf_counter() - t0
        self.metrics.onboard.labels(tier=source).observe(time.perf_counter() - t0)
        if n:
            self._publish(p.BlocksOnboarded(namespace=msg.namespace, hashes=msg.hashes[:n], worker_id=w.worker_id))
        return p.Onboarded(count=n, slots=slots, nbytes=nbytes)

    def _release(self, msg: p.Release, w: WorkerSession) -> p.Released:
        self._check_generation(msg)
        return p.Released(count=self.sessions.release(w, msg.keys()))

    def _drop_worker(self, w: WorkerSession, why: str, *, quarantine: bool = True) -> int:
        """Forget a worker: release its pins and abort its unfinished stores (its slots quarantined
        unless it said it is done: Unregister, or the daemon is shutting down)."""
        pins = self.sessions.drop(w, quarantine=quarantine, why=why)
        logj("worker.dropped", worker=w.worker_id, why=why, pins=pins)
        return pins

    def _stats(self, msg: p.Stats, _w: WorkerSession | None) -> p.StatsReply:
        return p.StatsReply(stats=self.snapshot(resident=msg.resident))

    async def _barrier(self, msg: p.Barrier, w: WorkerSession) -> p.BarrierReply:
        world = msg.world_size or w.tp_size
        key = (msg.engine_id, str(msg.step))
        ent = self._barriers.get(key)
        if ent is None:
            ent = (set(), asyncio.get_running_loop().create_future())
            self._barriers[key] = ent
        ranks, fut = ent
        ranks.add(msg.rank)
        if len(ranks) >= world and not fut.done():
            fut.set_result(None)
            self._barriers.pop(key, None)
        timeout = msg.timeout_s or self.dc.barrier_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if self._barriers.get(key) is ent:
                self._barriers.pop(key, None)
            return p.BarrierReply(arrived=len(ranks), complete=False)
        return p.BarrierReply(arrived=len(ranks), complete=True)

    async def _evict(self, msg: p.Evict, _w: WorkerSession) -> p.Evicted:
        names = [t.name for t in self.manager.tiers]
        tiers = msg.tiers or names
        bad = [t for t in tiers if t not in names]
        if bad:
            raise _Handled(p.E_BAD_REQUEST, f"unknown tiers {bad}; have {names}")
        reg = self.manager.registry
        if msg.hashes is not None:
            keys = [BlockKey(msg.namespace, h) for h in msg.hashes]
        else:
            seen: dict[BlockKey, None] = {}
            for t in tiers:
                seen.update((k, None) for k in reg.keys(t) if k.namespace == msg.namespace)
            keys = list(seen)
        free = [k for k in keys if not reg.is_pinned(k)]
        present = [k for k in free if any(reg.holds(t, k) for t in tiers)]
        removed = await self.manager.delete(present, tiers) if present else 0
        return p.Evicted(removed=removed, skipped=len(keys) - len(free))

    async def _reindex(self, msg: p.Reindex, _w: WorkerSession) -> p.Reindexed:
        names = msg.tiers or [t.name for t in self.manager.tiers if t.kind in PERSISTENT]
        unknown = [n for n in names if n not in self.manager.by_name]
        if unknown:
            raise _Handled(p.E_BAD_REQUEST, f"no tier {unknown[0]!r} here")
        reg = self.manager.registry
        blocks = added = 0
        for name in names:
            before = reg.count(name)
            blocks += await self.manager.index_tier(name, msg.namespace or None, refresh=True)
            added += reg.count(name) - before
        return p.Reindexed(blocks=blocks, added=added)

    # -- events, leases, reporting ---------------------------------------------------------------------
    def _on_registry(self, kind: str, tier: str, key: BlockKey) -> None:
        """Every tier change the manager makes (stores, cascades, evictions, demotions) becomes an event."""
        if self._pub is None or (self._learning and tier == self._shared):
            return
        # Stored blocks carry their size, so a peer indexes them without asking the bucket.
        nbytes = (self.manager.by_name[tier].nbytes(key) or 0) if kind == "stored" else 0
        self._pending_events.setdefault((kind, tier, key.namespace, nbytes), []).append(key.hash)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_events)

    def _flush_events(self) -> None:
        self._flush_scheduled = False
        pending, self._pending_events = self._pending_events, {}
        events: list[Any] = []
        for (kind, tier, ns, nbytes), hashes in pending.items():
            cls = p.BlocksStored if kind == "stored" else p.BlocksRemoved
            events.append(cls(namespace=ns, hashes=hashes, tier=tier, nbytes=nbytes))
        if events:
            self._publish(*events)

    def _publish(self, *events: Any) -> None:
        if self._pub is None:
            return
        buf = p.encode(p.EventBatch(ts=time.time(), events=list(events)), 1 << 62)
        try:
            self._pub.send_multipart([p.EVENTS_TOPIC, self._event_seq.to_bytes(8, "big"), buf], flags=zmq.NOBLOCK)
            self._event_seq += 1
            self.stats.events_published += 1
        except zmq.ZMQError:
            self.stats.dropped += 1

    async def _reaper(self) -> None:
        period = max(0.05, min(1.0, self.dc.worker_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for w in self.sessions.expired(self.dc.worker_timeout_s):
                self.stats.expired_workers += 1
                self._drop_worker(w, "lease expired")
            self.sessions.reap_quarantine()

    # -- fleet: other daemons sharing the bucket -------------------------------------------------------
    @contextlib.contextmanager
    def _learned(self) -> Any:
        self._learning = True
        try:
            yield
        finally:
            self._learning = False

    def _learn_probed(self, found: dict[BlockKey, int]) -> None:
        with self._learned():
            self.manager.learn(self._shared, found)

    def _apply_peer(self, peer: PeerFollower, batch: p.EventBatch) -> None:
        """A peer's G4 stores and removals are this daemon's too (same bucket, same keys); the rest is its own."""
        if not self._shared:
            return
        with self._learned():
            for ev in batch.events:
                if ev.tier != self._shared or isinstance(ev, p.BlocksOnboarded):
                    continue
                keys = [BlockKey(ev.namespace, h) for h in ev.hashes]
                if isinstance(ev, p.BlocksStored):
                    if self.probe is not None:
                        for k in keys:
                            self.probe.negative.discard(k)
                    if ev.nbytes > 0:  # else (a peer that does not say) the next lookup's probe finds them
                        self.manager.learn(self._shared, dict.fromkeys(keys, ev.nbytes))
                    peer.stats.stored += len(keys)
                else:
                    self.manager.forget(self._shared, keys)
                    peer.stats.removed += len(keys)

    def _peer_gap(self, _peer: PeerFollower) -> None:
        """Messages from a peer were lost: the blocks they announced may sit in the negative cache."""
        if self.probe is not None:
            self.probe.negative.clear()

    def _peer_curve(self) -> tuple[str, str, str] | None:
        """CURVE for following peers: their PUB's public key (``peer_curve_server_key``, else this daemon's own:
        a fleet sharing one server key pair) and this daemon's key pair as the client's (an ephemeral one when
        it has none; a peer with a client allow-list must list this daemon's public key)."""
        own_public, own_secret = self._curve_keys
        server = self.dc.peer_curve_server_key or own_public
        if not server:
            return None
        if own_secret and own_public:
            return server, own_public, own_secret
        public, secret = zmq.curve_keypair()
        return server, public.decode(), secret.decode()

    def fleet(self) -> dict[str, Any]:
        """What ``kvbm status`` shows of the fleet: peers followed, probe counters, negative-cache size."""
        return {
            "shared_tier": self._shared or None,
            "peers": [peer.describe() for peer in self.peers],
            "probe": self.probe.describe() if self.probe is not None else None,
        }

    def readiness(self) -> dict[str, Any]:
        """What ``/readyz`` answers (see :func:`kvbm.health.readiness`)."""
        serving = self.ready.is_set() and not self._stop.is_set()
        return readiness(self.snapshot() if serving else None, serving, self.dc.index_bucket)

    def snapshot(self, resident: bool = False) -> dict[str, Any]:
        """The manager's description plus the daemon's counters and the vLLM engines' views."""
        snap = self.manager.describe()
        d = msgspec.structs.asdict(self.stats)
        d["errors"] = dict(self.stats.errors)
        d.update(
            queue_depth=self._offloads, inflight=self._inflight, workers=len(self.workers),
            bucket_indexed=self._bucket_indexed.is_set(), bucket_index_error=self._bucket_index_error,
            namespaces_indexed=len(self._ns_indexed),
            pins=self.sessions.pin_total(), quarantined_slots=self.sessions.quarantined_slots(),
        )
        d["fleet"] = self.fleet()
        snap["daemon"] = d
        snap["engines"] = describe_views(self._subs)
        if resident:
            for sub in self._subs:
                snap["engines"][sub.view.engine_id]["resident"] = sorted(sub.view.resident(), key=str)
        return snap


def _curve_server(sock: zmq.asyncio.Socket, public: str, secret: str) -> None:
    if secret:
        sock.curve_server = True
        sock.curve_secretkey = secret.encode()
        sock.curve_publickey = public.encode()


def _prepare_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path and not path.startswith("@"):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


# -- structured logs -------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any ``kv`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "kv", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RedactFields(logging.Filter):
    """Secret-named structured fields (kvbm.redact's one rule) are masked before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        kv = getattr(record, "kv", None)
        if kv:
            record.kv = redact(kv)
        return True


def configure_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RedactFields())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(kv)s", defaults={"kv": ""}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def logj(event: str, level: int = logging.INFO, **kv: Any) -> None:
    """Log ``event`` with structured fields."""
    if log.isEnabledFor(level):
        log.log(level, event, extra={"kv": kv})


async def serve(cfg: Config, manager: BlockManager) -> None:
    """Run a daemon until cancelled or stopped by a signal."""
    daemon = Daemon(cfg, manager)
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.stop()))
    await daemon.run()
