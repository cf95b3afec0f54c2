"""Request handlers: one plain async (or quick sync) method per request type, taking the message and the
worker's session and returning the reply. No ZeroMQ here (see :mod:`kvbm.daemon.transport`), so the
handlers can be called directly. The slot requests (stores' and loads' G2 slots) are :mod:`kvbm.daemon.slots`'.

Pins: blocks onboarded for a worker stay pinned in G2 until it sends Release or Unregister, or its lease
runs out: the manager hands out read leases (``reserve_read``, as ``prepare_store`` on the store path) and
:mod:`kvbm.daemon.sessions` holds them; nothing here touches the registry or the G2 pool. Slot requests
carrying another G2 pool generation than this daemon's are refused (``E_STALE``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.config import DaemonConfig, TenantConfig
from kvbm.daemon.admin import AdminHandlers
from kvbm.daemon.auth import Credentials, Principal, authorize
from kvbm.daemon.barrier import Barriers
from kvbm.daemon.events import EventPublisher
from kvbm.daemon.indexing import BucketIndexer
from kvbm.daemon.logs import logj
from kvbm.daemon.metrics import Metrics
from kvbm.daemon.peer_reads import PeerReads
from kvbm.daemon.prefetch import Prefetcher
from kvbm.daemon.sessions import Sessions, WorkerSession
from kvbm.daemon.slots import SlotHandlers, g2_of
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Handled
from kvbm.fleet import BucketProbe
from kvbm.manager.core import BlockManager
from kvbm.security import token_matches
from kvbm.tiers.names import FAST


class Service:
    """The daemon's request logic, wired to the manager, the sessions and the daemon's helpers."""

    def __init__(self, dc: DaemonConfig, manager: BlockManager, sessions: Sessions, stats: DaemonStats,
                 metrics: Metrics, *, indexer: BucketIndexer, probe: BucketProbe | None, prefetcher: Prefetcher,
                 publisher: EventPublisher, snapshot: Callable[[bool], dict[str, Any]]) -> None:
        self.dc = dc
        self.manager = manager
        self.sessions = sessions
        self.stats = stats
        self.metrics = metrics
        self.indexer = indexer
        self.probe = probe
        self.prefetcher = prefetcher
        self.publisher = publisher
        self.barriers = Barriers(dc.barrier_timeout_s)
        self.creds = Credentials()  # the admin and tenant tokens, set by the daemon at run(); never logged
        self.admin = AdminHandlers(manager)  # Evict, Reindex (authorised for admin sessions only: kvbm.daemon.auth)
        self._snapshot = snapshot
        self.peer_reads: PeerReads | None = None  # fleet.p2p: a lookup reads a peer's G2 blocks (set by the daemon)
        self.slots = SlotHandlers(manager, sessions, stats, metrics, publisher)  # stores' and loads' G2 slots
        # Quick requests are answered inline by the receive loop; the others each get a task.
        self.inline: dict[type, Callable[[Any, Any], Any]] = {
            p.Unregister: self.unregister, p.Ping: self.ping, p.Release: self.slots.release, p.Stats: self.stats_reply,
        }
        self.handlers: dict[type, Callable[[Any, Any], Any]] = {
            p.Register: self.register,
            p.Lookup: self.lookup,  # a task: it may wait (probe_budget_ms) for a bucket probe
            p.PrepareStore: self.slots.prepare, p.CommitStore: self.slots.commit, p.Onboard: self.slots.onboard,
            p.Barrier: self.barrier, p.Evict: self.admin.evict, p.Reindex: self.admin.reindex,
        }

    def admit(self, msg: Any) -> WorkerSession | None:
        """The session a request comes from (None: Register, or a monitor); raises Handled when refused."""
        worker = None
        if not isinstance(msg, p.Register):
            worker = self.sessions.workers.get(msg.token)
            # Monitors (kvbm status, health checks) may read stats, and Ping without a token, unregistered. A
            # Ping with an unknown token still gets E_UNREGISTERED: that worker's lease ran out, it must register.
            monitor = isinstance(msg, p.Stats) or (isinstance(msg, p.Ping) and not msg.token)
            if worker is None and not monitor:
                raise Handled(p.E_UNREGISTERED, self.sessions.unknown_token(msg))
            if worker is not None:
                worker.last_seen = time.monotonic()
        denied = authorize(msg, worker, self.creds)
        if denied:
            raise Handled(p.E_FORBIDDEN, denied)
        return worker

    @property
    def admin_token(self) -> str:
        return self.creds.admin_token

    @admin_token.setter
    def admin_token(self, token: str) -> None:
        self.creds.admin_token = token

    def client_of(self, msg: Any, worker: WorkerSession | None, conn: bytes) -> tuple[object, int]:
        """Whose request this is, for the in-flight cap, and that cap: a tenant's requests count together
        (its ``max_inflight``), another session's on its own, an unregistered one's per connection."""
        if worker is not None:
            if worker.admin:
                return "admin", self.dc.max_inflight  # the operator is bounded by the daemon's cap only
            if worker.max_inflight:
                return worker.principal, worker.max_inflight
            return worker.token, self.dc.max_inflight_per_client
        if isinstance(msg, p.Register) and msg.tenant_token:
            for t, tok in self.creds.tenants:
                if token_matches(msg.tenant_token, tok):
                    return f"tenant:{t.name}", t.max_inflight
        return conn, self.dc.max_inflight_per_client

    def drop_worker(self, w: WorkerSession, why: str, *, quarantine: bool = True) -> int:
        """Forget a worker: release its pins and abort its unfinished stores (its slots quarantined
        unless it said it is done: Unregister, or the daemon is shutting down)."""
        pins = self.sessions.drop(w, quarantine=quarantine, why=why)
        logj("worker.dropped", worker=w.worker_id, why=why, pins=pins)
        return pins

    # -- sessions --------------------------------------------------------------------------------------
    async def register(self, msg: p.Register, _w: None) -> p.Registered:
        g2 = g2_of(self.manager)
        layout = msg.layout
        if layout.block_nbytes > g2.slot_bytes:
            raise Handled(p.E_BAD_REQUEST, f"layout blocks are {layout.block_nbytes} B; G2 slots {g2.slot_bytes} B")
        if not 0 <= msg.tp_rank < max(msg.tp_size, 1):
            raise Handled(p.E_BAD_REQUEST, f"tp_rank {msg.tp_rank} outside [0, {msg.tp_size})")
        for name in ("model", "backend", "revision", "dtype"):
            if len(getattr(layout, name)) > p.MAX_STR:
                raise Handled(p.E_LIMIT, f"layout.{name} is longer than {p.MAX_STR} characters")
        who = self.creds.principal(msg)  # checked by authorize already: this only names it
        self._check_place(msg, who)  # before the bucket is listed: a refused Register costs no LIST
        if not await self.indexer.index_namespace(layout.namespace, self.dc.register_index_wait_s):
            logj("register.index_pending", namespace=layout.namespace, waited_s=self.dc.register_index_wait_s)
        self._check_place(msg, who)  # again: others registered while we listed. No await from here to add.
        t = who.tenant
        for old in self.sessions.by_worker_id(msg.worker_id):
            self.drop_worker(old, "re-registered")
        token = secrets.token_hex(16)
        admin = who.admin
        ranks = max(msg.tp_size, 1) * max(layout.pp_size, 1)  # the engine's workers, all sharing G2
        principal_slots, slots = self.slot_budgets(t, ranks) if not admin else (0, 0)
        self.sessions.add(token, msg, admin=admin, principal=who.name, max_inflight=t.max_inflight if t else 0,
                          slots=slots, principal_slots=principal_slots)
        self.stats.registered += 1
        logj("worker.registered", worker=msg.worker_id, engine=msg.engine_id, rank=msg.tp_rank,
             namespace=layout.namespace, admin=admin, tenant=t.name if t else "")
        return p.Registered(
            token=token, namespace=layout.namespace, shm_name=getattr(g2, "shm_name", ""),
            generation=self.slots.generation, slot_bytes=g2.slot_bytes, num_slots=g2.num_slots,
            capacity_bytes=g2.capacity_bytes, block_nbytes=layout.block_nbytes, session_slots=slots or g2.num_slots,
        )

    def slot_budgets(self, tenant: TenantConfig | None, ranks: int) -> tuple[int, int]:
        """(the principal's G2 slot budget, 0 when unbounded; a new session's): a tenant's ``max_slots`` or an
        equal share of G2; a session's ``daemon.max_session_slots`` or its principal's over its engine's
        ``ranks`` (tp_size x pp_size: the ranks of one engine together fit)."""
        num = g2_of(self.manager).num_slots
        principal = (tenant.max_slots or max(1, num // len(self.creds.tenants))) if tenant is not None else 0
        of = min(principal or num, num)
        session = min(self.dc.max_session_slots, of) if self.dc.max_session_slots else max(1, of // ranks)
        return principal, session

    def _check_place(self, msg: p.Register, who: Principal) -> None:
        """Raises Handled unless ``who`` may take a place for ``msg``: its worker_id, its max_workers."""
        if why := self.sessions.owner_conflict(msg.worker_id, who.name):
            raise Handled(p.E_FORBIDDEN, why)
        t = who.tenant
        if why := self.sessions.refusal(msg, admin=who.admin, principal=who.name, cap=t.max_workers if t else 0,
                                        field=f"max_workers of tenant {t.name!r}" if t else "daemon.max_workers"):
            raise Handled(p.E_LIMIT, why)

    def unregister(self, _msg: p.Unregister, w: WorkerSession) -> p.Released:
        return p.Released(count=self.drop_worker(w, "unregistered", quarantine=False))

    def ping(self, _msg: p.Ping, _w: WorkerSession | None) -> p.Pong:
        return p.Pong()

    def stats_reply(self, msg: p.Stats, _w: WorkerSession | None) -> p.StatsReply:
        return p.StatsReply(stats=self._snapshot(msg.resident))

    async def barrier(self, msg: p.Barrier, w: WorkerSession) -> p.BarrierReply:
        # A Barrier holds an in-flight place while it waits: never longer than daemon.barrier_timeout_s.
        msg.timeout_s = min(msg.timeout_s or self.dc.barrier_timeout_s, self.dc.barrier_timeout_s)
        return await self.barriers.arrive(msg, msg.world_size or w.tp_size, w.principal)

    # -- blocks ----------------------------------------------------------------------------------------
    async def lookup(self, msg: p.Lookup, w: WorkerSession) -> p.LookupReply:
        """The fastest tier of each block of the leading run held anywhere. A run that ends short of the request
        while G4 is enabled starts a bucket probe of the next blocks (another node may have stored them); the
        reply waits for it up to ``probe_budget_ms``: a probe done by then is in this reply, a slower one fills
        the index for the next lookup (and starts the prefetch of what it found)."""
        t0 = time.perf_counter()
        # Matched straight from the request's hashes; BlockKeys only where a probe or a prefetch needs them.
        tiers = self.manager.lookup_hashes(msg.namespace, msg.hashes)
        if self.peer_reads is not None:  # blocks a peer holds in G2/G3 and this daemon only in the bucket
            tiers = await self.peer_reads.fill(msg.namespace, msg.hashes, tiers)
        keys: list[BlockKey] = []
        if len(tiers) < len(msg.hashes) and self.probe is not None:
            keys = msg.keys()
            probe = self.probe.start(keys[len(tiers) :])
            if probe is not None:
                if self.dc.probe_budget_ms > 0:
                    await asyncio.wait({probe}, timeout=self.dc.probe_budget_ms / 1000)
                if probe.done():
                    tiers = self.manager.relookup(keys, tiers)
                else:
                    self.probe.stats.late += 1
                    if self.dc.prefetch:
                        probe.add_done_callback(lambda _t: self.prefetcher.after_probe(keys, w))
        self.stats.lookup_seconds += time.perf_counter() - t0
        self.metrics.lookup.labels(tier=self.metrics.slowest(tiers)).observe(time.perf_counter() - t0)
        if self.dc.prefetch and any(t not in FAST for t in tiers):
            self.prefetcher.after_lookup(keys or msg.keys(), tiers, w)
        return p.LookupReply(matched=len(tiers), tiers=tiers)

    # -- slot requests (kvbm.daemon.slots; here too for callers of the handlers by name) ------------------
    async def prepare(self, msg: p.PrepareStore, w: WorkerSession) -> p.Slots:
        return await self.slots.prepare(msg, w)

    async def commit(self, msg: p.CommitStore, w: WorkerSession) -> p.Ack:
        return await self.slots.commit(msg, w)

    async def onboard(self, msg: p.Onboard, w: WorkerSession) -> p.Onboarded:
        return await self.slots.onboard(msg, w)

    def release(self, msg: p.Release, w: WorkerSession) -> p.Released:
        return self.slots.release(msg, w)
