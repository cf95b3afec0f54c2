"""The serving side of peer reads: another daemon asks this one to pin blocks in its G2 so it can READ them
with NIXL (see :mod:`kvbm.fleet.p2p` for the conversation, :mod:`kvbm.daemon.peer_reads` for the asking side).

* **Who may ask.** The socket is secured as the request socket (CURVE and its client allow-list when the daemon
  has keys). A :class:`~kvbm.fleet.p2p.Connect` names the asker's credential; on a daemon with tenants it must
  be the admin token (every namespace) or a tenant's token (that tenant's ``namespaces``, the binding a worker's
  Register has), and a Pin of any other namespace is refused ``forbidden``.
* **Load.** At most ``fleet.peer_read_max_inflight`` pins are held at once; beyond it a Pin is answered ``busy``
  at once (the asker reads the bucket instead): peer reads never queue in front of this daemon's own workers.
* **Leases.** A Pin brings the leading run of the blocks held in G1-G3 into G2 (a G3 block is staged first; the
  bucket's blocks are the asker's to read) and leases their slots, as an Onboard does for a worker, until the
  asker's Unpin or ``fleet.peer_read_lease_ms`` after the pin, whichever comes first: an asker that dies
  mid-read leaves nothing pinned here.
* **Checksums.** Each pinned block's xxh3-64 (:mod:`kvbm.daemon.peer_sums`: summed in the background after its
  store, else at its first pin, kept while it stays in the same slot), so the asker detects bytes that changed in
  flight or in memory.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvbm.blocks import BlockKey
from kvbm.config.fleet import FleetConfig
from kvbm.daemon.auth import Credentials
from kvbm.daemon.logs import logj
from kvbm.daemon.peer_sums import SlotChecksums
from kvbm.daemon.transport import curve_server
from kvbm.fleet import p2p as m
from kvbm.manager.core import BlockManager
from kvbm.manager.leases import Lease
from kvbm.security import token_matches
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier
from kvbm.transfer.peer import PeerAgent

log = logging.getLogger(__name__)
SERVABLE = frozenset({TierName.G1, TierName.G2, TierName.G3})  # a peer reads the bucket itself


class ServeStats(msgspec.Struct):
    connects: int = 0
    pins: int = 0  # Pins answered with blocks
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    unpins: int = 0
    expired: int = 0  # leases dropped at their deadline (the asker never said it was done)
    refused_forbidden: int = 0
    refused_busy: int = 0
    refused_other: int = 0
    leases: int = 0  # held now
    reserve_seconds: float = 0.0  # Pins bringing blocks to G2 and leasing their slots
    checksum_seconds: float = 0.0  # Pins checksumming blocks not checksummed before
    checksums_computed: int = 0
    checksums_known: int = 0  # known at the Pin (summed ahead after its store, or at an earlier pin)
    checksums_ahead: int = 0  # blocks summed in the background after their store (kvbm.daemon.peer_sums)
    checksums_from_reads: int = 0  # blocks read from a peer here: the checksum they were verified against, kept
    pinned_slots: int = 0  # G2 slots those leases hold now


MAX_ASKERS = 1024  # connected askers remembered at most (the oldest forgotten: it connects again)


class _Asker:
    __slots__ = ("admin", "agent_name", "namespaces", "node_id", "open")

    def __init__(self, node_id: str, agent_name: str, admin: bool, namespaces: frozenset[str] | None) -> None:
        self.node_id = node_id
        self.agent_name = agent_name
        self.admin = admin
        self.namespaces = namespaces  # None: any (admin, or a daemon without tenants)
        self.open = True


def credential(creds: Credentials, token: str) -> tuple[bool, frozenset[str] | None, str]:
    """(admin, the namespaces it may read (None: any), why refused ("" when accepted)) for an asker's token:
    the binding a worker's Register has, by namespace (a Pin names no model, so a tenant's ``models`` globs
    grant nothing here: list its namespaces)."""
    if token and token_matches(token, creds.admin_token):
        return True, None, ""
    if not creds.tenants:
        return False, None, ""
    if not token:
        return False, frozenset(), ("this daemon serves tenants: a peer must present its admin token or a tenant's "
                                    "token (fleet.peer_read_token_file)")
    tenant = next((t for t, tok in creds.tenants if token_matches(token, tok)), None)
    if tenant is None:
        return False, frozenset(), "unknown token (fleet.peer_read_token_file)"
    return False, frozenset(tenant.namespaces), ""


class PeerReadServer:
    """The ROUTER socket peers ask for pins on, and the leases it holds for them."""

    def __init__(self, fc: FleetConfig, manager: BlockManager, creds: Callable[[], Credentials]) -> None:
        self.fc = fc
        self.manager = manager
        self._creds = creds
        self.stats = ServeStats()
        self.endpoint = ""
        self.instance = secrets.token_hex(8)
        self.agent: PeerAgent | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._askers: dict[bytes, _Asker] = {}
        self._leases: dict[int, tuple[list[Lease], asyncio.TimerHandle, bytes]] = {}
        self._pinning = 0  # Pins between admission and their lease (count against the cap)
        self._ids = itertools.count(1)
        self.sums = SlotChecksums(manager.registry, self.g2)  # each G2 block's xxh3, summed ahead of its Pin

    @property
    def g2(self) -> SlotPoolTier:
        tier = self.manager.by_name[TierName.G2]
        assert isinstance(tier, SlotPoolTier)
        return tier

    def bind(self, ctx: zmq.asyncio.Context, agent: PeerAgent, public: str, secret: str) -> str:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_P2P_MESSAGE)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to an asker gone away raises: its pin is dropped at once
        curve_server(sock, public, secret)  # the request socket's keys and ZAP rules (its client allow-list)
        sock.bind(self.fc.p2p_endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self.agent = agent
        return self.endpoint

    async def serve(self, spawn: Callable[[Any], asyncio.Task[Any]]) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            spawn(self._answer(frames[0], frames[1], frames[2]))

    async def _answer(self, ident: bytes, rid: bytes, buf: bytes) -> None:
        try:
            msg = m.decode_request(buf)
            if msg.v != m.P2P_VERSION:
                reply: Any = m.Refused(code=m.E_VERSION, message=f"peer-read protocol {msg.v}, this daemon "
                                                                  f"speaks {m.P2P_VERSION}")
            elif isinstance(msg, m.Connect):
                reply = await self._connect(ident, msg)
            elif isinstance(msg, m.Pin):
                reply = await self._pin(ident, msg)
            else:
                reply = m.Unpinned(count=self.unpin(msg.lease, ident))
        except msgspec.DecodeError as e:
            self.stats.refused_other += 1
            reply = m.Refused(code=m.E_BAD, message=f"malformed peer-read request: {e}")
        except Exception as e:  # one bad request must not stop the socket
            log.exception("peer read: request failed")
            self.stats.refused_other += 1
            reply = m.Refused(code=m.E_BAD, message=f"{type(e).__name__}: {e}")
        if self._sock is not None:
            try:
                await self._sock.send_multipart([ident, rid, m.encode(reply)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                if isinstance(reply, m.Pinned) and reply.lease:
                    self.unpin(reply.lease, ident)  # the asker is gone: nobody will read or release them

    async def _connect(self, ident: bytes, msg: m.Connect) -> m.Connected | m.Refused:
        admin, namespaces, why = credential(self._creds(), msg.token)
        if why:
            self.stats.refused_forbidden += 1
            logj("p2p.refused", level=logging.WARNING, peer=msg.node_id, why=why)
            return m.Refused(code=m.E_FORBIDDEN, message=why)
        assert self.agent is not None
        name = await asyncio.to_thread(self.agent.add_remote, msg.agent)
        # A node that connects again (restarted: a new socket identity) replaces its old entry, and the entries
        # are capped: neither grows with reconnections. Its old leases still end at their deadline.
        stale = [i for i, a in self._askers.items() if i == ident or a.node_id == msg.node_id]
        stale += list(self._askers)[: max(0, len(self._askers) - len(stale) + 1 - MAX_ASKERS)]
        gone = [old.agent_name for i in stale if (old := self._askers.pop(i, None)) is not None
                and old.agent_name != name]
        self._askers[ident] = _Asker(msg.node_id, name, admin, namespaces)
        for old_name in gone:  # NIXL's endpoint teardown may block: a thread, never the loop
            await asyncio.to_thread(self.agent.remove_remote, old_name)
        self.stats.connects += 1
        logj("p2p.connected", peer=msg.node_id, agent=name, admin=admin)
        g2 = self.g2
        return m.Connected(agent_name=self.agent.name, agent=await asyncio.to_thread(self.agent.metadata),
                           pool_addr=self.agent.pool_addr, slot_bytes=g2.slot_bytes, num_slots=g2.num_slots,
                           instance=self.instance)

    async def _pin(self, ident: bytes, msg: m.Pin) -> m.Pinned | m.Refused:
        asker = self._askers.get(ident)
        if asker is None:
            self.stats.refused_other += 1
            return m.Refused(code=m.E_NOT_CONNECTED, message="Connect first")
        if asker.namespaces is not None and msg.namespace not in asker.namespaces:
            self.stats.refused_forbidden += 1
            logj("p2p.refused", level=logging.WARNING, peer=asker.node_id, namespace=msg.namespace,
                 why="namespace not readable with the asker's credential")
            return m.Refused(code=m.E_FORBIDDEN, message=f"namespace {msg.namespace!r} is not readable with this "
                                                         "peer's credential (its tenant's namespaces)")
        if len(self._leases) + self._pinning >= self.fc.peer_read_max_inflight:
            self.stats.refused_busy += 1
            return m.Refused(code=m.E_BUSY, message=f"{self.fc.peer_read_max_inflight} peer reads in flight "
                                                    "(fleet.peer_read_max_inflight)")
        if len(msg.hashes) > self.fc.peer_read_max_blocks:
            self.stats.refused_other += 1
            return m.Refused(code=m.E_BAD, message=f"{len(msg.hashes)} blocks asked, at most "
                                                   f"{self.fc.peer_read_max_blocks} (fleet.peer_read_max_blocks)")
        keys = [BlockKey(msg.namespace, h) for h in msg.hashes]
        run = self.manager.held_run(keys)
        n = next((i for i, t in enumerate(run) if t not in SERVABLE), len(run))
        if n == 0:
            return m.Pinned(lease=0, slots=[], nbytes=[], checksums=[], lease_ms=self.fc.peer_read_lease_ms)
        self._pinning += 1
        t0 = time.monotonic()
        try:
            leases = await self.manager.reserve_read(keys[:n], TierName.G2)
        finally:
            self._pinning -= 1
        t1 = time.monotonic()
        self.stats.reserve_seconds += t1 - t0
        try:  # all known (summed ahead, or an earlier pin): answered here, no thread hop (100 ms under load)
            leased = [(le.key, le.slot, le.nbytes) for le in leases]
            known = self.sums.all_known((k, slot) for k, slot, _n in leased)
            sums = self.sums.sums(leased) if known else await asyncio.to_thread(self.sums.sums, leased)
        except BaseException:
            self.manager.release(leases)
            raise
        self.stats.checksum_seconds += time.monotonic() - t1
        if not leases:
            return m.Pinned(lease=0, slots=[], nbytes=[], checksums=[], lease_ms=self.fc.peer_read_lease_ms)
        lease = next(self._ids)
        timer = asyncio.get_running_loop().call_later(self.fc.peer_read_lease_ms / 1000, self._expire, lease)
        self._leases[lease] = (leases, timer, ident)
        self.stats.pins += 1
        self.stats.pinned_blocks += len(leases)
        self.stats.pinned_bytes += sum(le.nbytes for le in leases)
        return m.Pinned(lease=lease, slots=[le.slot for le in leases], nbytes=[le.nbytes for le in leases],
                        checksums=sums, lease_ms=self.fc.peer_read_lease_ms)

    def unpin(self, lease: int, ident: bytes) -> int:
        got = self._leases.get(lease)
        if got is None or got[2] != ident:
            return 0
        del self._leases[lease]
        got[1].cancel()
        self.stats.unpins += 1
        return self.manager.release(got[0])

    def _expire(self, lease: int) -> None:
        got = self._leases.pop(lease, None)
        if got is not None:
            self.stats.expired += 1
            self.manager.release(got[0])
            logj("p2p.lease_expired", level=logging.WARNING, lease=lease, blocks=len(got[0]))

    def describe(self) -> dict[str, Any]:
        self.stats.leases = len(self._leases)
        self.stats.pinned_slots = sum(len(v[0]) for v in self._leases.values())
        self.stats.checksums_computed, self.stats.checksums_known = self.sums.computed, self.sums.known
        self.stats.checksums_ahead, self.stats.checksums_from_reads = self.sums.summed_ahead, self.sums.from_reads
        d = msgspec.structs.asdict(self.stats)
        d.update(endpoint=self.endpoint, instance=self.instance, askers=len(self._askers))
        return d

    def close(self) -> None:
        self.sums.close()
        for lease in list(self._leases):
            got = self._leases.pop(lease)
            got[1].cancel()
            self.manager.release(got[0])
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
