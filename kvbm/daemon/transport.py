"""The request socket: bind (CURVE, client allow-list), framing, admission, the receive loop and replies.

Request logic lives in :mod:`kvbm.daemon.service`; this module only moves frames. Admission: with
``max_queue`` PrepareStore/CommitStore requests of one principal (a tenant, or the sessions without one) in
flight, a new PrepareStore of that principal is answered :class:`~kvbm.protocol.Shed` (one tenant's durable
commits waiting on a slow S3 do not shed another's stores); with ``max_inflight`` requests of any kind in flight
the loop stops reading (ZeroMQ queues, then the clients time out). Before that, each client (a tenant, a worker
session, an unregistered connection: :meth:`RequestService.client_of`) has its own cap: a request beyond it is answered
``busy`` at once (load: retry later; ``limit`` means a field out of bounds), so one client's flood (say
Barriers that wait) neither stops the loop nor delays others. An admitted request's handler starts in its
client's turn (:mod:`kvbm.daemon.fairness`): one client's backlog does not sit in front of another's request.
Bad frames get an Error reply (or are dropped) and are counted;
none stops the daemon.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.config import DaemonConfig
from kvbm.daemon.fairness import FairStarts
from kvbm.daemon.logs import logj
from kvbm.daemon.sessions import WorkerSession
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.zap import Zap, public_keys
from kvbm.errors import KvbmError, TierFullError, TierUnavailableError
from kvbm.security import prepare_ipc

log = logging.getLogger("kvbm.daemon")

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class Handled(Exception):
    """Raised by request logic to answer with an Error reply of ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestService(Protocol):
    """What the transport needs of the request logic (:class:`kvbm.daemon.service.Service`)."""

    inline: dict[type, Callable[[Any, Any], Any]]
    handlers: dict[type, Callable[[Any, Any], Coroutine[Any, Any, Any]]]

    def admit(self, msg: Any) -> WorkerSession | None: ...

    def client_of(self, msg: Any, worker: WorkerSession | None, conn: bytes) -> tuple[object, int]: ...


def curve_server(sock: zmq.asyncio.Socket, public: str, secret: str) -> None:
    if secret:
        sock.curve_server = True
        sock.curve_secretkey = secret.encode()
        sock.curve_publickey = public.encode()


class Transport:
    """The ROUTER socket: one request in, one reply out, each handled in its own task unless it is quick."""

    def __init__(self, dc: DaemonConfig, ctx: zmq.asyncio.Context, stats: DaemonStats, spawn: Spawn,
                 zap: Zap) -> None:
        self.dc = dc
        self.stats = stats
        self.endpoint = dc.endpoint
        self.inflight = 0  # requests of any kind in flight
        self.offloads = 0  # PrepareStore/CommitStore in flight (the queue depth)
        self.offloads_of: dict[str, int] = {}  # the same, per principal: each has its own max_queue
        self.per_client: dict[object, int] = {}  # requests in flight per client (RequestService.client_of)
        self._ctx = ctx
        self._spawn = spawn
        self._router: zmq.asyncio.Socket | None = None
        self._zap = zap
        self._slot_free = asyncio.Event()
        self._sync: zmq.Socket[Any] | None = None  # the plain view of the ROUTER that serve() reads and replies on
        self._readable = asyncio.Event()  # the ROUTER's FD signalled, or a send may have hidden a queued request
        self._fair = FairStarts(dc.fair_burst)  # which admitted request starts next: per client, round-robin

    @property
    def curve(self) -> bool:
        return self._router is not None and bool(self._router.curve_server)

    def bind(self, public: str, secret: str) -> None:
        dc = self.dc
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # libzmq drops the connection of a peer that sends more than this; between max_message_bytes
        # and it, the daemon still answers with an Error.
        router.setsockopt(zmq.MAXMSGSIZE, 4 * dc.max_message_bytes + 1024)
        if secret:
            if not zmq.has("curve"):
                raise KvbmError("daemon CURVE keys are set but libzmq has no CURVE support")
            # The request socket's domain (the default one); the events socket may name its own (kvbm.daemon.zap).
            self._zap.curve("*", public_keys(dc.curve_clients_dir) if dc.curve_clients_dir else None)
        curve_server(router, public, secret)
        prepare_ipc(dc.endpoint, "endpoint")
        router.bind(dc.endpoint)
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = router

    def close(self) -> None:
        if self._router is not None:
            self._router.close(0)

    async def serve(self, service: RequestService) -> None:
        """Receive and dispatch until cancelled.

        The socket is read through a plain (non-asyncio) view of it: every request queued when the loop
        wakes is taken in one pass, with no future per receive. ZeroMQ's FD only signals edges, so the
        queue is drained until empty, and after a send (which may consume the edge) :meth:`_send` re-arms.
        """
        assert self._router is not None
        sock = self._sync = zmq.Socket.shadow(self._router.underlying)
        loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        self._readable.set()
        loop.add_reader(fd, self._readable.set)
        burst = 0
        try:
            while True:
                if burst >= 64:  # a steady stream of requests must not starve the handlers' tasks
                    burst = 0
                    await asyncio.sleep(0)
                if self.inflight >= self.dc.max_inflight:
                    # ZeroMQ's FD stays readable while commands wait unprocessed, and nothing reads the socket
                    # until a slot frees: without this the loop would wake for it over and over (a busy spin).
                    loop.remove_reader(fd)
                    try:
                        while self.inflight >= self.dc.max_inflight:
                            self._slot_free.clear()
                            await self._slot_free.wait()
                    finally:
                        loop.add_reader(fd, self._readable.set)
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    self._readable.clear()
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        await self._readable.wait()
                    continue
                burst += 1
                try:
                    self.dispatch(frames, service)
                except Exception:  # never let one request take the daemon down
                    log.exception("dispatch failed")
                    self.stats.dropped += 1
        finally:
            loop.remove_reader(fd)
            self._sync = None

    def dispatch(self, frames: list[bytes], service: RequestService) -> None:
        self.stats.requests += 1
        if len(frames) == 2:
            ident, envelope, payload = frames[0], [], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            ident, envelope, payload = frames[0], [b""], frames[2]
        else:
            self.stats.dropped += 1
            self.count_error("frames")
            return
        route = [ident, *envelope]
        try:
            msg = p.decode_request(payload, self.dc.max_message_bytes)
        except p.ProtocolError as e:
            self._error(route, e.rid, e.code, e.message)
            return
        try:
            worker = service.admit(msg)
        except Handled as e:
            self._error(route, msg.rid, e.code, str(e))
            return
        inline = service.inline.get(type(msg))
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
        queue = worker.principal if worker is not None else ""
        if isinstance(msg, p.PrepareStore) and self.offloads_of.get(queue, 0) >= self.dc.max_queue:
            self.stats.shed += 1
            self._send(route, p.Shed(rid=msg.rid))
            return
        client, cap = service.client_of(msg, worker, ident)
        held = self.per_client.get(client, 0)
        if held >= cap:
            self.stats.client_limited += 1
            self._error(route, msg.rid, p.E_BUSY, f"{held} requests of this client are in flight (its cap: "
                                                   f"daemon.max_inflight_per_client or its tenant's max_inflight)")
            return
        self.per_client[client] = held + 1
        self.inflight += 1
        self.offloads += offload
        if offload:
            self.offloads_of[queue] = self.offloads_of.get(queue, 0) + 1
        handler = service.handlers[type(msg)]
        if not self._fair.start(client, lambda: self._spawn(self._handle(route, msg, worker, handler,
                                                                           queue if offload else None, client))):
            self.stats.deferred += 1

    async def _handle(self, route: list[bytes], msg: Any, worker: WorkerSession | None, handler: Any,
                      queue: str | None, client: object) -> None:
        try:
            reply = await handler(msg, worker)
        except Exception as e:
            self._done(queue, client)
            self._fail(route, msg, e)
            return
        except BaseException:
            self._done(queue, client)
            raise
        # Counted out before the reply leaves: a request the client sends once it has the reply (a Stats,
        # read in the same loop turn) must not see this one still in flight.
        self._done(queue, client)
        reply.rid = msg.rid
        self._send(route, reply)

    def _done(self, queue: str | None, client: object) -> None:
        """A request ended; ``queue``: the principal of an offload (PrepareStore/CommitStore), None otherwise."""
        self.inflight -= 1
        if queue is not None:
            self.offloads -= 1
            if left := self.offloads_of.pop(queue, 1) - 1:
                self.offloads_of[queue] = left
        left = self.per_client.pop(client, 1) - 1
        if left:
            self.per_client[client] = left
        self._slot_free.set()

    def _fail(self, route: list[bytes], msg: Any, e: Exception) -> None:
        if isinstance(e, Handled):
            code = e.code
        elif isinstance(e, TierFullError):
            code = p.E_FULL
        elif isinstance(e, TierUnavailableError):  # the daemon's outage, not the caller's mistake
            code = p.E_UNAVAILABLE
        elif isinstance(e, (KvbmError, ValueError)):
            code = p.E_BAD_REQUEST
        else:
            log.exception("%s failed", type(msg).__name__, exc_info=e)
            code = p.E_INTERNAL
        self._error(route, msg.rid, code, str(e) if code != p.E_INTERNAL else f"{type(e).__name__}: {e}")

    def _send(self, route: list[bytes], msg: Any) -> None:
        sock = self._sync or self._router
        assert sock is not None
        try:
            buf = p.encode(msg, self.dc.max_message_bytes)
        except p.ProtocolError as e:
            buf = p.encode(p.Error(rid=msg.rid, code=e.code, message=e.message))
        try:
            sock.send_multipart([*route, buf], flags=zmq.NOBLOCK)
            self.stats.replies += 1
        except zmq.ZMQError as e:  # peer gone / HWM: the reply is lost, the client times out
            self.stats.dropped += 1
            log.debug("reply dropped: %s", e)
        self._readable.set()  # the send may have taken the FD's edge for a request now queued: look again

    def _error(self, route: list[bytes], rid: int, code: str, message: str) -> None:
        self.count_error(code)
        logj("request.error", code=code, rid=rid, message=message[:200], level=logging.DEBUG)
        self._send(route, p.Error(rid=rid, code=code, message=message))

    def count_error(self, code: str) -> None:
        self.stats.errors[code] = self.stats.errors.get(code, 0) + 1
