"""Slot requests: a store's PrepareStore/CommitStore and a load's Onboard/Release, the G2 slots a worker copies
into or out of (split from :mod:`kvbm.daemon.service`, which routes them here).

Each slot request carries the G2 pool generation the worker mapped; another than this daemon's is refused
(``E_STALE``). What a session may hold is its slot budgets' (:mod:`kvbm.daemon.sessions`): a store beyond them is
refused ``full``, a load pins the leading run that fits.
"""

from __future__ import annotations

import time

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.daemon.auth import check_store
from kvbm.daemon.events import EventPublisher
from kvbm.daemon.metrics import Metrics
from kvbm.daemon.sessions import Sessions, WorkerSession
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Handled
from kvbm.errors import KvbmError, TierFullError
from kvbm.manager.core import BlockManager
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier


def g2_of(manager: BlockManager) -> SlotPoolTier:
    """The host slot pool workers share: the daemon cannot serve without one."""
    tier = manager.by_name.get(TierName.G2)
    if not isinstance(tier, SlotPoolTier):
        raise KvbmError("the daemon needs a G2 host tier (workers share its slots)")
    return tier


class SlotHandlers:
    """PrepareStore, CommitStore, Onboard and Release, wired to the manager and the sessions."""

    def __init__(self, manager: BlockManager, sessions: Sessions, stats: DaemonStats, metrics: Metrics,
                 publisher: EventPublisher) -> None:
        self.manager = manager
        self.sessions = sessions
        self.stats = stats
        self.metrics = metrics
        self.publisher = publisher

    @property
    def generation(self) -> str:
        return getattr(g2_of(self.manager), "generation", "")

    def _check_generation(self, msg: p._SlotReq) -> None:
        if msg.generation != self.generation:
            raise Handled(p.E_STALE, f"G2 pool generation {msg.generation!r} is not this daemon's "
                                     f"({self.generation!r}): register again and map the new pool")

    async def prepare(self, msg: p.PrepareStore, w: WorkerSession) -> p.Slots:
        check_store(msg, w)
        self._check_generation(msg)
        slot_bytes = g2_of(self.manager).slot_bytes
        if not 0 < msg.nbytes <= slot_bytes:
            raise Handled(p.E_BAD_REQUEST, f"nbytes {msg.nbytes} outside (0, {slot_bytes}]")
        t0 = time.perf_counter()
        keys = msg.keys()
        need = 0

        def admit(n: int) -> None:  # the slots the store would take, before it waits for room
            nonlocal need
            if why := self.sessions.no_room(w, n):
                raise Handled(p.E_FULL, why)
            self.sessions.reserve(w, n)  # counted while we wait for room: a concurrent request sees it
            need = n

        try:
            slots = await self.manager.prepare_store(keys, msg.nbytes, TierName.G2, admit)
        finally:
            self.sessions.unreserve(w, need)
            self.stats.offload_seconds += time.perf_counter() - t0
            self.metrics.store.labels(op="prepare").observe(time.perf_counter() - t0)
        if not self.sessions.alive(w):  # dropped while we waited (nothing copied yet): give the slots back
            self.manager.complete_store([k for k, s in zip(keys, slots, strict=True) if s is not None], ok=False)
            raise Handled(p.E_UNREGISTERED, "worker left")
        self.sessions.prepared(w, keys, slots)
        return p.Slots(slots=slots)

    async def commit(self, msg: p.CommitStore, w: WorkerSession) -> p.Ack:
        check_store(msg, w)
        self._check_generation(msg)
        t0 = time.perf_counter()
        keys = msg.keys()
        if msg.covers and len(msg.covers) != len(keys):
            raise Handled(p.E_BAD_REQUEST, f"covers: {len(msg.covers)} lists for {len(keys)} hashes")
        mine = self.sessions.take_prepared(w, keys)
        stored = self.manager.complete_store(mine, msg.ok, cascade=not msg.durable, partial=msg.partial)
        if msg.ok and msg.covers:  # the partial blocks these full blocks begin with leave every tier
            self.manager.supersede(keys, [[BlockKey(msg.namespace, h) for h in c] for c in msg.covers])
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

    async def onboard(self, msg: p.Onboard, w: WorkerSession) -> p.Onboarded:
        self._check_generation(msg)
        t0 = time.perf_counter()
        keys = msg.keys()
        run = self.manager.held_run(keys)
        held = len(run)
        room = self.sessions.room(w, held)  # what it may pin: the leading held run, as far as the budgets go
        if run and not room:
            raise Handled(p.E_FULL, self.sessions.no_room(w, len(run)))
        if room < len(run):
            keys, run = keys[:room], run[:room]
        source = self.metrics.slowest(run)  # the tier the onboard's latency comes from
        self.sessions.reserve(w, len(run))
        stopped: list[BaseException] = []
        try:
            # The worker's leases: each block pinned in G2 and its very slot referenced until it releases it.
            leases = await self.manager.reserve_read(keys, TierName.G2, stopped)
        finally:
            self.sessions.unreserve(w, len(run))
        if self.sessions.alive(w):
            self.sessions.pin(w, leases)
        else:  # dropped while we waited: nobody will release them
            self.manager.release(leases)
            leases = []
        n = len(leases)
        self.stats.onboard_seconds += time.perf_counter() - t0
        self.metrics.onboard.labels(tier=source).observe(time.perf_counter() - t0)
        if n:
            self.publisher.publish(p.BlocksOnboarded(namespace=msg.namespace, hashes=msg.hashes[:n],
                                                     worker_id=w.worker_id))
        # Short for want of room (the session's budget, or G2 full of pinned blocks: TierFullError), the held run is
        # said, so the worker may ask again once pins are released; short otherwise (a block lost, a read failing
        # on the way: asking again would not help): what was pinned.
        short_of_room = room < held or any(isinstance(e, TierFullError) for e in stopped)
        return p.Onboarded(count=n, slots=[lease.slot for lease in leases], nbytes=[lease.nbytes for lease in leases],
                           held=held if short_of_room else n)

    def release(self, msg: p.Release, w: WorkerSession) -> p.Released:
        self._check_generation(msg)
        return p.Released(count=self.sessions.release(w, msg.keys()))
