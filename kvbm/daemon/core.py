"""The :class:`Daemon`: wires the transport, the request service, the sessions and the background helpers
together, runs them, and reports (snapshot, readiness). It holds no request logic of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

import msgspec
import zmq.asyncio

from kvbm.config import Config
from kvbm.daemon.auth import load_credentials
from kvbm.daemon.events import EventPublisher
from kvbm.daemon.health import readiness
from kvbm.daemon.indexing import BucketIndexer
from kvbm.daemon.kvevents import KVEventSubscriber, describe_views
from kvbm.daemon.logs import logj
from kvbm.daemon.metrics import Metrics, MetricsServer
from kvbm.daemon.peering import FleetMember, read_peer_token, shared_tier
from kvbm.daemon.prefetch import Prefetcher
from kvbm.daemon.router_events import RouterEventPublisher, check_bind
from kvbm.daemon.service import Service, g2_of
from kvbm.daemon.sessions import Sessions, WorkerSession
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Transport
from kvbm.daemon.warmth import Warmth
from kvbm.daemon.zap import Zap
from kvbm.manager.core import BlockManager
from kvbm.security import admin_token_path, check_binds, check_key_dirs, exposure, read_public_keys, server_keys
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier

STORE_TIER = TierName.G2  # where workers store and onboard: the shared slot pool


def quarantine_grace_s(worker_timeout_s: float, configured: float | None = None) -> float:
    """How long an expired worker's slots stay quarantined at most: ``daemon.quarantine_grace_s``, else (it was
    already silent a whole lease) two more leases and at least 30 s to finish a copy it may have been stalled in."""
    return max(30.0, 2 * worker_timeout_s) if configured is None else configured


class Daemon:
    """Binds the daemon's sockets and serves until :meth:`stop`."""

    def __init__(self, cfg: Config, manager: BlockManager, *, ctx: zmq.asyncio.Context | None = None) -> None:
        self.cfg = cfg
        self.dc = dc = cfg.daemon
        self.manager = manager
        self.stats = DaemonStats()
        self.sessions = Sessions(manager, STORE_TIER, quarantine_grace_s(dc.worker_timeout_s, dc.quarantine_grace_s),
                                 dc.max_workers)
        self.workers: dict[str, WorkerSession] = self.sessions.workers
        self.metrics_port: int | None = None
        self.ready = asyncio.Event()
        self._ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self._curve_keys = ("", "")  # (public, secret) Z85, read at run()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[KVEventSubscriber] = []  # vLLM KV-event streams followed (shown in Stats)
        self._metrics: MetricsServer | None = None
        shared = shared_tier(manager)
        self.zap = Zap(self._ctx)  # the context's one ZAP handler: both sockets' admission rules
        self.transport = Transport(dc, self._ctx, self.stats, self._spawn, self.zap)
        self.publisher = EventPublisher(manager, self.stats, shared.name if shared is not None else "")
        self.fleet_member = FleetMember(dc, manager, self.publisher, cfg.fleet)
        self.router_events = RouterEventPublisher(cfg.router_events, manager.registry,
                                                  {t.name: t.kind for t in manager.tiers})
        self.probe = self.fleet_member.probe
        self.peers = self.fleet_member.peers
        self.indexer = BucketIndexer(manager, dc.index_bucket, self._spawn, wanted=self.sessions.uses)
        self.warmth = Warmth(dc, manager, self._spawn)
        # Latency histograms: observed by the handlers, the manager's copies and the S3 tier's requests.
        self.metrics = Metrics(self.snapshot, self.readiness, [t.name for t in manager.tiers])
        manager.observe_copy = self.metrics.observe_copy
        for tier in manager.tiers:
            if tier.kind == "s3":
                tier.observe = self.metrics.observe_s3  # type: ignore[attr-defined]
        self.service = Service(dc, manager, self.sessions, self.stats, self.metrics, indexer=self.indexer,
                               probe=self.probe, prefetcher=Prefetcher(manager, self.stats, dc.max_prefetch,
                                                                       self._spawn, self.sessions),
                               publisher=self.publisher, snapshot=lambda resident: self.snapshot(resident=resident))
        self.service.peer_reads = self.fleet_member.peer_reads

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    @property
    def events_endpoint(self) -> str:
        return self.publisher.endpoint or self.dc.events_endpoint

    @property
    def g2(self) -> SlotPoolTier:
        return g2_of(self.manager)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Start the manager (re-indexing persistent tiers), bind, and serve until :meth:`stop`."""
        _ = self.g2
        # Refuse an unsafe socket set-up before touching any tier (a disk index can take a while).
        # Every credential file and the metrics port too: a bad one is an error naming its field now, not minutes in.
        self._curve_keys = server_keys(self.dc)
        check_binds(self.dc, curve=bool(self._curve_keys[1]))
        check_bind(self.cfg.router_events, self.dc)
        await asyncio.to_thread(check_key_dirs, self.dc)
        peer_token = await asyncio.to_thread(read_peer_token, self.dc)
        token_path = admin_token_path(self.dc)
        self.service.creds = await asyncio.to_thread(load_credentials, self.dc, token_path)
        if self.dc.metrics_port:
            self._metrics = MetricsServer(self.metrics, self.dc.metrics_host, max(self.dc.metrics_port, 0))
            self.metrics_port = await self._metrics.bind()
        # The bucket is listed apart from the other tiers: S3 being down must not stop G2/G3 serving.
        # A G3 it cannot write (read-only, immutable) is opened read-only: served, and read to pay what it owes G4.
        # One that cannot start at all is turned off and logged: G2 and G4 still serve.
        await self.manager.start(index=("device", "host", "disk"), optional=("disk",))
        for name, why in self.manager.state.off.items():
            logj("tier.off", level=logging.ERROR, tier=name, why=why)
        for tier in self.manager.tiers:
            if tier.read_only is not None:
                logj("tier.read_only", level=logging.ERROR, tier=tier.name, why=tier.read_only)
        await self.indexer.start()
        self.transport.bind(*self._curve_keys)
        if self.dc.events_endpoint:
            # With tenants, a tenant's process may reach the events socket: only the operator subscribes.
            admin_keys = (read_public_keys(self.dc.curve_admin_clients_dir, "daemon.curve_admin_clients_dir")
                          if self.dc.curve_admin_clients_dir else set())
            self.publisher.bind(self._ctx, self.dc.events_endpoint, *self._curve_keys, zap=self.zap,
                                admin_token=self.service.creds.admin_token if self.dc.tenants else "",
                                admin_keys=admin_keys)
        for i, ep in enumerate(self.dc.vllm_events):
            replay = self.dc.vllm_replay[i] if i < len(self.dc.vllm_replay) else ""
            sub = KVEventSubscriber(ep, replay, mode=self.dc.vllm_events_mode, ctx=self._ctx)
            sub.open()
            self._subs.append(sub)
            self._spawn(sub.run())
        if self.cfg.router_events.endpoint:
            self.router_events.bind(self._ctx, self._spawn)
        self.fleet_member.follow(self._ctx, self._curve_keys, self._spawn, self.publisher.endpoint, peer_token,
                                 self.service.creds)
        if self._metrics is not None:
            await self._metrics.start()
        self._spawn(self._reaper())
        self.warmth.start()
        self.indexer.serve()
        for why in exposure(self.dc, self.transport.curve):
            logj("daemon.exposed", message=why, level=logging.WARNING)
        logj("daemon.started", endpoint=self.endpoint, events=self.events_endpoint, metrics_port=self.metrics_port,
             curve=self.transport.curve, admin_token_file=str(token_path),
             tiers=[t.name for t in self.manager.tiers], blocks=len(self.manager.registry), pid=os.getpid())
        self.ready.set()
        recv = asyncio.ensure_future(self.transport.serve(self.service))
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

    async def _shutdown(self) -> None:
        await self.fleet_member.withdraw()  # while the bucket client is still up
        await self.warmth.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in list(self.workers.values()):
            self.service.drop_worker(w, "shutdown", quarantine=False)
        for sub in self._subs:
            sub.close()
        await self.fleet_member.close()
        if self._metrics is not None:
            await self._metrics.close()
        self.transport.close()
        self.publisher.close()
        self.router_events.close()
        self.zap.stop()
        await self.manager.drain()
        if self._own_ctx:
            self._ctx.term()
        logj("daemon.stopped", **{k: v for k, v in msgspec.structs.asdict(self.stats).items() if k != "errors"})

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _reaper(self) -> None:
        """Drop workers whose lease (``worker_timeout_s`` since their last request) ran out."""
        period = max(0.05, min(1.0, self.dc.worker_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for w in self.sessions.expired(self.dc.worker_timeout_s):
                self.stats.expired_workers += 1
                self.service.drop_worker(w, "lease expired")
            self.sessions.reap_quarantine()

    # -- reporting -------------------------------------------------------------------------------------
    def fleet(self) -> dict[str, Any]:
        """What ``kvbm status`` shows of the fleet: peers followed, probe counters, negative-cache size."""
        return self.fleet_member.describe()

    def readiness(self) -> dict[str, Any]:
        """What ``/readyz`` answers (see :func:`kvbm.daemon.health.readiness`)."""
        serving = self.ready.is_set() and not self._stop.is_set()
        return readiness(self.snapshot() if serving else None, serving, self.dc.index_bucket)

    def snapshot(self, resident: bool = False) -> dict[str, Any]:
        """The manager's description plus the daemon's counters and the vLLM engines' views."""
        snap = self.manager.describe()
        d = msgspec.structs.asdict(self.stats)
        d["errors"] = dict(self.stats.errors)
        d.update(
            queue_depth=self.transport.offloads, inflight=self.transport.inflight, workers=len(self.workers),
            bucket_indexed=self.indexer.indexed.is_set(), bucket_index_error=self.indexer.error,
            namespaces_indexed=len(self.indexer.namespaces), namespaces_pending=len(self.indexer.pending),
            prewarm=self.warmth.prewarm,
            pins=self.sessions.pin_total(), quarantined_slots=self.sessions.quarantined_slots(),
            refused_workers=self.sessions.refused,
        )
        d["fleet"] = self.fleet()
        d["router_events"] = self.router_events.describe()
        snap["daemon"] = d
        snap["engines"] = describe_views(self._subs)
        if resident:
            for sub in self._subs:
                snap["engines"][sub.view.engine_id]["resident"] = sorted(sub.view.resident(), key=str)
        return snap


async def serve(cfg: Config, manager: BlockManager) -> None:
    """Run a daemon until cancelled or stopped by a signal."""
    daemon = Daemon(cfg, manager)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(daemon.stop()))
    await daemon.run()
