"""Worker sessions: what the daemon holds on behalf of each registered worker, in one place.

A session owns the worker's lease (``last_seen``), its pins (blocks it onboarded: the manager's read leases,
:mod:`kvbm.manager.leases`, each a registry pin plus a reference on the exact G2 slot it was handed) and its
prepared stores (key -> slot it is copying into). It holds them as opaque values and gives them back through
the manager: it never touches the registry nor the pool itself.

Dropping a session: on Unregister or daemon shutdown the worker is done with its slots, so they are
released at once. On lease expiry or a re-registration under the same ``worker_id`` the old worker may
still be copying (a stalled process): its prepared stores are aborted (the keys may be stored again by
others) and its pins leave the registry, but every slot it was handed stays referenced, in quarantine,
until that worker's token shows up again naming those keys (its CommitStore is refused with a clear
"lease expired" error, its Release just releases) or a grace period (``grace_s``,
``daemon.quarantine_grace_s``) passes. A slot is thus reused only when no worker can still read or write it.

Registrations are capped per principal (whom a session acts for: a tenant, or the one tenant of a daemon
without tenants) so a Register flood cannot grow the daemon without bound nor take another tenant's places:
``daemon.max_workers`` for sessions without a tenant, each tenant's ``max_workers`` for its own.
:meth:`Sessions.refusal` says why one more is refused (counted in ``refused``). A re-registration under a
``worker_id`` that holds a place replaces it, but only from the same principal (a worker_id belongs to the
credential that created it), and admin sessions (the operator's CLI) are not counted, so an operator can
still look into a full daemon. Expired and unregistered workers free their places.

Slot budgets: the G2 slots a session holds (pinned + prepared + reserved by a slot request in progress) are
capped per session (``slots``, stated in Registered.session_slots) and, summed over its sessions and its
quarantines, per principal (a tenant's ``max_slots``), so one tenant pinning and pinging cannot hold all of
G2. :meth:`Sessions.no_room` says why a request for more is refused (the daemon answers ``full``: load), and
:meth:`Sessions.room` how much more fits (an Onboard pins that much of its run). A worker_id that registers again
(a restarted engine) is no longer charged for its earlier sessions' quarantines (their slots stay referenced until
the grace ends), at most its principal's budget forgiven at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.manager.core import BlockManager
from kvbm.manager.leases import Lease


class WorkerSession:
    """One registered worker (one TP rank of one engine)."""

    def __init__(self, token: str, msg: p.Register, *, admin: bool = False, principal: str = "",
                 max_inflight: int = 0, slots: int = 0, principal_slots: int = 0) -> None:
        self.token = token
        self.admin = admin  # registered with the admin token: any namespace, Evict, Reindex
        self.principal = principal  # whom it acts for ("", "admin", "tenant:<name>"): owns its worker_id
        self.max_inflight = max_inflight  # its principal's cap on requests in flight (0: the daemon's per client)
        self.worker_id = msg.worker_id
        self.engine_id = msg.engine_id
        self.tp_rank = msg.tp_rank
        self.tp_size = msg.tp_size
        self.layout = msg.layout
        self.namespace = msg.layout.namespace
        self.pins: dict[BlockKey, list[Lease]] = {}  # key -> read leases handed out by Onboard (one per Onboard)
        self.prepared: dict[BlockKey, int] = {}  # key -> G2 slot handed out by PrepareStore
        self.last_seen = time.monotonic()
        self.slots = slots  # G2 slots it may hold at once (0: unbounded, an admin session)
        self.principal_slots = principal_slots  # its principal's, over all its sessions (0: unbounded)
        self.npins = 0  # slots in ``pins``
        self.reserved = 0  # slots counted for slot requests in progress (before their pins/prepared exist)

    def pin_count(self) -> int:
        return self.npins

    def held(self) -> int:
        """G2 slots this session holds or is being given."""
        return self.npins + len(self.prepared) + self.reserved


class _Quarantine:
    """The slots of a dropped worker that may still be copying."""

    def __init__(self, pins: dict[BlockKey, list[Lease]], prepared: dict[BlockKey, Lease], until: float, why: str,
                 principal: str = "", worker_id: str = ""):
        self.principal = principal  # charged for these slots, until its worker_id registers again (``charged``)
        self.worker_id = worker_id
        self.charged = True
        self.pins = pins
        self.prepared = prepared
        self.until = until
        self.why = why

    def empty(self) -> bool:
        return not self.pins and not self.prepared

    def slots(self) -> int:
        return sum(len(s) for s in self.pins.values()) + len(self.prepared)


class Sessions:
    """Every worker session and every G2 slot reference held for a worker."""

    def __init__(self, manager: BlockManager, store_tier: str, grace_s: float, max_workers: int = 1024) -> None:
        self.manager = manager
        self.store_tier = store_tier
        self.grace_s = grace_s
        self.max_workers = max_workers
        self.refused = 0  # registrations refused because max_workers were registered
        self.workers: dict[str, WorkerSession] = {}
        self._quarantine: dict[str, _Quarantine] = {}
        self.held: dict[str, int] = {}  # G2 slots held per principal: its sessions' and its quarantines'

    # -- membership -------------------------------------------------------------------------------------
    def add(self, token: str, msg: p.Register, *, admin: bool = False, principal: str = "",
            max_inflight: int = 0, slots: int = 0, principal_slots: int = 0) -> WorkerSession:
        w = WorkerSession(token, msg, admin=admin, principal=principal, max_inflight=max_inflight, slots=slots,
                          principal_slots=principal_slots)
        self.workers[token] = w
        self._forgive(w)
        return w

    def _forgive(self, w: WorkerSession) -> None:
        """Stop charging ``w``'s principal for the quarantines of earlier sessions of ``w``'s worker_id: it
        registered again (a restarted engine), so it would otherwise start up to ``grace_s`` short of its budget.
        The slots stay referenced until their quarantine ends (a stalled old process may still copy), and a
        principal is forgiven at most its budget at once (re-registering in a loop cannot take all of G2)."""
        forgiven = sum(q.slots() for q in self._quarantine.values() if q.principal == w.principal and not q.charged)
        for q in self._quarantine.values():
            if q.charged and q.worker_id == w.worker_id and q.principal == w.principal:
                if w.principal_slots and forgiven + q.slots() > w.principal_slots:
                    continue
                q.charged = False
                forgiven += q.slots()
                self._charge(q.principal, -q.slots())

    def refusal(self, msg: p.Register, *, admin: bool = False, principal: str = "", cap: int = 0,
                field: str = "daemon.max_workers") -> str:
        """Why ``msg`` may not register (counted), or "" when it may: ``cap`` (default ``max_workers``) workers
        of ``principal`` hold a place and it would not replace one of them (same ``worker_id``). Admin
        sessions never count."""
        if admin:
            return ""
        cap = cap or self.max_workers
        held = sum(1 for w in self.workers.values()
                   if not w.admin and w.principal == principal and w.worker_id != msg.worker_id)
        if held < cap:
            return ""
        self.refused += 1
        return f"{held} workers are registered ({field}); retry once one unregisters or expires"

    def owner_conflict(self, worker_id: str, principal: str) -> str:
        """Why ``principal`` may not take ``worker_id`` ("" when it may): another principal's session holds it."""
        if any(w.principal != principal for w in self.by_worker_id(worker_id)):
            return (f"worker_id {worker_id!r} belongs to another credential's session: a worker_id is replaced "
                    f"only by a Register with the credential that created it")
        return ""

    def get(self, token: str) -> WorkerSession | None:
        return self.workers.get(token)

    def alive(self, w: WorkerSession) -> bool:
        return self.workers.get(w.token) is w

    def __len__(self) -> int:
        return len(self.workers)

    def uses(self, namespace: str) -> bool:
        """Whether a registered worker uses ``namespace``."""
        return any(w.namespace == namespace for w in self.workers.values())

    def by_worker_id(self, worker_id: str) -> list[WorkerSession]:
        return [w for w in self.workers.values() if w.worker_id == worker_id]

    def expired(self, timeout_s: float) -> list[WorkerSession]:
        cutoff = time.monotonic() - timeout_s
        return [w for w in self.workers.values() if w.last_seen < cutoff]

    # -- slot budgets ---------------------------------------------------------------------------------
    def _charge(self, principal: str, n: int) -> None:
        left = self.held.get(principal, 0) + n
        if left:
            self.held[principal] = left
        else:
            self.held.pop(principal, None)

    def no_room(self, w: WorkerSession, n: int) -> str:
        """Why ``w`` may not be given ``n`` more G2 slots ("" when it may): its session's or its principal's
        budget would be passed."""
        if n <= 0:
            return ""
        held = self.held.get(w.principal, 0)
        if w.principal_slots and held + n > w.principal_slots:
            who = w.principal.removeprefix("tenant:")
            return (f"tenant {who!r} slot budget: {held} G2 slots held by its sessions + {n} asked > "
                    f"{w.principal_slots} (its max_slots in daemon.tenants); release or commit first")
        if w.slots and w.held() + n > w.slots:
            return (f"session slot budget: {w.held()} G2 slots held + {n} asked > {w.slots} "
                    f"(Registered.session_slots, daemon.max_session_slots); release or commit first")
        return ""

    def room(self, w: WorkerSession, n: int) -> int:
        """How many of ``n`` more G2 slots ``w`` may be given within its session's and its principal's budgets
        (an Onboard pins that much of its run: a shorter run is a hit, a refusal is a recompute)."""
        if w.principal_slots:
            n = min(n, w.principal_slots - self.held.get(w.principal, 0))
        if w.slots:
            n = min(n, w.slots - w.held())
        return max(0, n)

    def reserve(self, w: WorkerSession, n: int) -> None:
        """Count ``n`` slots for a request in progress (checked with :meth:`no_room` first)."""
        w.reserved += n
        self._charge(w.principal, n)

    def unreserve(self, w: WorkerSession, n: int) -> None:
        w.reserved -= n
        self._charge(w.principal, -n)

    # -- stores -----------------------------------------------------------------------------------------
    def prepared(self, w: WorkerSession, keys: Iterable[BlockKey], slots: Iterable[int | None]) -> None:
        before = len(w.prepared)
        for k, s in zip(keys, slots, strict=True):
            if s is not None:
                w.prepared[k] = s
        self._charge(w.principal, len(w.prepared) - before)

    def take_prepared(self, w: WorkerSession, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """The keys among ``keys`` this worker prepared (no longer its to commit afterwards)."""
        mine = [k for k in keys if w.prepared.pop(k, None) is not None]
        self._charge(w.principal, -len(mine))
        return mine

    # -- pins -------------------------------------------------------------------------------------------
    def pin(self, w: WorkerSession, leases: list[Lease]) -> None:
        """Record read leases (:meth:`BlockManager.reserve_read`) handed to ``w``."""
        for lease in leases:
            w.pins.setdefault(lease.key, []).append(lease)
        w.npins += len(leases)
        self._charge(w.principal, len(leases))

    def release(self, w: WorkerSession, keys: Iterable[BlockKey]) -> int:
        """Drop one pin per key (the lease handed out first); returns pins released."""
        done: list[Lease] = []
        for k in keys:
            leases = w.pins.get(k)
            if not leases:
                continue
            done.append(leases.pop(0))
            if not leases:
                del w.pins[k]
        self.manager.release(done)
        w.npins -= len(done)
        self._charge(w.principal, -len(done))
        return len(done)

    # -- dropping -------------------------------------------------------------------------------------
    def drop(self, w: WorkerSession, *, quarantine: bool, why: str = "") -> int:
        """Forget a worker; returns the pins it held. See the module docstring for ``quarantine``."""
        if self.workers.pop(w.token, None) is None:
            return 0
        pins = w.pin_count()
        leases = [lease for held in w.pins.values() for lease in held]
        prepared = list(w.prepared)
        self._charge(w.principal, -(pins + len(prepared)))
        if quarantine and (w.pins or prepared):
            self.manager.detach_read(leases)  # evictable again; the slots stay referenced until the grace ends
            detached = self.manager.detach_store(prepared)
            q = _Quarantine(w.pins, detached, time.monotonic() + self.grace_s, why, w.principal, w.worker_id)
            self._quarantine[w.token] = q
            self._charge(w.principal, q.slots())
        else:
            self.manager.release(leases)
            if prepared:
                self.manager.complete_store(prepared, ok=False)
        w.pins = {}
        w.prepared = {}
        w.npins = 0
        return pins

    def unknown_token(self, msg: p.Request) -> str:
        """The error message for a request from a token with no session; a dropped worker's request
        naming quarantined keys ends their quarantine (it has finished copying)."""
        q = self._quarantine.get(msg.token)
        if q is None:
            return "unknown worker token; send Register first"
        if isinstance(msg, p.Unregister):
            self._unquarantine(q, list(q.pins), list(q.prepared))
        elif isinstance(msg, p.CommitStore):
            self._unquarantine(q, [], msg.keys())
        elif isinstance(msg, p.Release):
            self._unquarantine(q, msg.keys(), [])
        if q.empty():
            del self._quarantine[msg.token]
        return f"worker {q.why}: its token is gone and its unfinished stores were aborted; send Register"

    def _unquarantine(self, q: _Quarantine, pins: Iterable[BlockKey], prepared: Iterable[BlockKey]) -> None:
        before = q.slots()
        self._release_quarantined(q, pins, prepared)
        if q.charged:
            self._charge(q.principal, q.slots() - before)

    def _release_quarantined(self, q: _Quarantine, pins: Iterable[BlockKey], prepared: Iterable[BlockKey]) -> None:
        done = [lease for k in pins for lease in q.pins.pop(k, [])]
        done += [lease for k in prepared if (lease := q.prepared.pop(k, None)) is not None]
        self.manager.release(done)

    def reap_quarantine(self) -> int:
        """Release quarantines whose grace period is over; returns slots released."""
        now = time.monotonic()
        n = 0
        for token, q in list(self._quarantine.items()):
            if q.until <= now:
                n += q.slots()
                self._unquarantine(q, list(q.pins), list(q.prepared))
                del self._quarantine[token]
        return n

    def quarantined_slots(self) -> int:
        return sum(q.slots() for q in self._quarantine.values())

    def pin_total(self) -> int:
        return sum(w.pin_count() for w in self.workers.values())
