"""The daemon's peering with the rest of its fleet (see :mod:`kvbm.fleet`): learning what the other daemons sharing
the bucket store and delete.

It owns the bucket probe, the peer followers (``daemon.peers`` and the members discovery finds) and the
discovery loop, and applies what they learn to the manager's index of the shared tier, inside
:meth:`EventPublisher.learned` so it is not republished.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.config import DaemonConfig, FleetConfig
from kvbm.daemon.auth import Credentials
from kvbm.daemon.events import EVENTS_USER, EventPublisher
from kvbm.daemon.logs import logj
from kvbm.daemon.peer_reads import PeerReads, read_token
from kvbm.daemon.peer_serve import PeerReadServer
from kvbm.daemon.transport import Spawn
from kvbm.errors import ConfigError
from kvbm.fleet import BucketProbe, PeerFollower, p2p
from kvbm.fleet.members import Discovery, Membership, host_local
from kvbm.fleet.peers import Residency
from kvbm.manager.core import BlockManager
from kvbm.security import read_token_file
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier
from kvbm.tiers.s3 import S3Tier
from kvbm.transfer.peer import PeerAgent

log = logging.getLogger(__name__)
WITHDRAW_S = 3.0  # how long a stopping daemon tries to delete its membership (else it expires)
HELLO_S = 1.0  # how often a daemon serving peer reads announces its peer-read socket on its events stream


def shared_tier(manager: BlockManager) -> S3Tier | None:
    return next((t for t in manager.tiers if isinstance(t, S3Tier)), None)


class FleetMember:
    """Bucket probe plus peer followers, wired to the manager's index of the shared tier."""

    def __init__(self, dc: DaemonConfig, manager: BlockManager, publisher: EventPublisher,
                 fleet: FleetConfig | None = None) -> None:
        self.dc = dc
        self.fc = fleet or FleetConfig()
        self.manager = manager
        self.publisher = publisher
        shared = shared_tier(manager)
        self.shared = shared.name if shared is not None else ""
        self.probe: BucketProbe | None = None
        if shared is not None and dc.probe:
            self.probe = BucketProbe(shared, self._learn_probed, concurrency=dc.probe_concurrency,
                                     max_blocks=dc.probe_max_blocks, negative_ttl_s=dc.probe_negative_ttl_s,
                                     negative_max=dc.probe_negative_max)
        self.peers: list[PeerFollower] = []  # every follower: static ones first, then discovered ones
        self.discovery: Discovery | None = None
        self._found: dict[str, tuple[PeerFollower, asyncio.Task[Any]]] = {}  # node -> its follower and task
        self._static: set[str] = set(dc.peers)
        self._named: dict[str, PeerFollower] = {}  # node -> the configured follower its endpoint matched
        self._ctx: zmq.asyncio.Context | None = None
        self._curve_keys = ("", "")
        self._peer_token = ""
        self._spawn: Spawn | None = None
        # Peer reads (fleet.p2p): serving this daemon's G2 to peers, and reading theirs (kvbm.daemon.peer_*).
        self.p2p_server: PeerReadServer | None = None
        self.peer_reads: PeerReads | None = None
        self.p2p_error = ""
        if self.fc.p2p:
            self.peer_reads = PeerReads(self.fc, manager, lambda: self.peers, dc.node_id or socket.gethostname())
        self._agent: PeerAgent | None = None

    def follow(self, ctx: zmq.asyncio.Context, curve_keys: tuple[str, str], spawn: Spawn,
               events_endpoint: str = "", peer_token: str = "", creds: Credentials | None = None) -> None:
        """Open a follower per ``daemon.peers`` endpoint; with ``daemon.discovery``, announce this daemon
        (its bound ``events_endpoint``) and follow the members found in the bucket. ``peer_token``
        (:func:`read_peer_token`) is what a follower presents to a peer with tenants and no CURVE."""
        self._ctx, self._curve_keys, self._spawn = ctx, curve_keys, spawn
        self._peer_token = peer_token
        # Only with daemon.peer_token_file, and, once daemon.peer_token_endpoints lists any, only to those: a
        # configured peer without tenants (a NULL socket) refuses PLAIN.
        listed = self.dc.peer_token_endpoints
        for ep in self.dc.peers:
            static_plain = (EVENTS_USER, peer_token) if peer_token and (not listed or ep in listed) else None
            peer = PeerFollower(ep, ctx, self._apply_peer, self._peer_gap, curve=self._peer_curve(curve_keys),
                                plain=static_plain)
            peer.open()
            self.peers.append(peer)
            spawn(peer.run())
        shared = shared_tier(self.manager)
        if self.dc.discovery and shared is not None and events_endpoint:
            announced = announced_endpoint(self.dc, events_endpoint)
            why = host_local(announced)
            if why:  # other hosts will not follow it (kvbm.fleet.members): say so where the operator looks
                logj("fleet.announce_local", level=logging.WARNING, endpoint=announced,
                     message=f"discovery announces {announced}: {why}; daemons on other hosts will not follow this "
                             "one (set daemon.announce_endpoint to an address they can reach)")
            # Followers must know whether this daemon's events socket asks for PLAIN (EventPublisher.bind).
            auth = "plain" if self.dc.tenants and not curve_keys[1] else ""
            self.discovery = Discovery(shared, self.dc.node_id, announced, curve_keys[0], join=self._join,
                                       leave=self._leave, interval_s=self.dc.discovery_interval_s,
                                       ttl_s=self.dc.discovery_ttl_s, events_auth=auth)
            spawn(self.discovery.run())
        if self.peer_reads is not None:
            spawn(self._start_p2p(creds or Credentials()))

    async def _start_p2p(self, creds: Credentials) -> None:
        """Create the NIXL agent (its G2 registered), bind the peer-read socket, announce it every HELLO_S. A
        daemon whose NIXL does not work serves without peer reads and says why (``kvbm status``)."""
        assert self._ctx is not None and self._spawn is not None and self.peer_reads is not None
        g2 = self.manager.by_name.get(TierName.G2)
        try:
            if not isinstance(g2, SlotPoolTier):
                raise ConfigError("fleet.p2p needs a G2 host tier")
            token = await asyncio.to_thread(read_token, self.fc)
            self._agent = agent = await asyncio.to_thread(PeerAgent, g2.pool)
        except Exception as e:
            self.p2p_error = f"{type(e).__name__}: {e}"
            logj("p2p.unavailable", level=logging.ERROR, message=f"fleet.p2p: no peer reads: {self.p2p_error}")
            return
        server = self.p2p_server = PeerReadServer(self.fc, self.manager, lambda: creds)
        self.peer_reads.verified = server.sums.known_now
        bound = server.bind(self._ctx, agent, *self._curve_keys)
        self._spawn(server.serve(self._spawn))
        self.peer_reads.start(self._ctx, agent, token, lambda peer: peer.curve)
        hello = p2p.encode(p2p.Hello(node_id=self.dc.node_id or socket.gethostname(),
                                     endpoint=self.fc.announce_p2p_endpoint or wildcard_to_host(bound),
                                     instance=server.instance))
        logj("p2p.started", endpoint=bound, agent=agent.name)
        while True:
            self.publisher.hello(hello)
            await asyncio.sleep(HELLO_S)

    def _join(self, m: Membership) -> None:
        """Follow a member discovery found (again, when its endpoint, key or process changed)."""
        self._leave(m.node_id)
        if m.events_endpoint in self._static:  # already followed as a configured peer: name it
            for peer in self.peers[: len(self.dc.peers)]:
                if peer.endpoint == m.events_endpoint:
                    peer.stats.node_id = m.node_id
                    self._named[m.node_id] = peer
            return
        assert self._ctx is not None and self._spawn is not None
        curve = self._peer_curve(self._curve_keys, m.curve_public_key) if m.curve_public_key else None
        plain, withheld = None, ""
        if m.events_auth == "plain" and self._peer_token:
            # Only to an endpoint the operator named: a forged membership must not be sent the token in clear.
            if m.events_endpoint in self.dc.peer_token_endpoints:
                plain = (EVENTS_USER, self._peer_token)
            else:
                withheld = (f"it asks for the peer token (PLAIN, sent in clear) and its endpoint is not in "
                            f"daemon.peer_token_endpoints: not sent (list {m.events_endpoint} there to follow it)")
                logj("fleet.token_withheld", level=logging.WARNING, node=m.node_id, endpoint=m.events_endpoint,
                     message=f"member {m.node_id}: {withheld}")
        peer = PeerFollower(m.events_endpoint, self._ctx, self._apply_peer, self._peer_gap, curve=curve,
                            plain=plain, node_id=m.node_id, withheld=withheld)
        peer.open()
        self.peers.append(peer)
        self._found[m.node_id] = (peer, self._spawn(peer.run()))
        log.info("fleet: following %s at %s", m.node_id, m.events_endpoint)

    def _leave(self, node: str) -> None:
        named = self._named.pop(node, None)
        if named is not None:
            named.stats.node_id = ""  # the configured follower stays
        got = self._found.pop(node, None)
        if got is None:
            return
        peer, task = got
        self.peers.remove(peer)
        if self.peer_reads is not None:
            self.peer_reads.forget_peer(peer.endpoint)
        task.cancel()
        task.add_done_callback(lambda _t: peer.close())  # its sockets close once nothing awaits them
        log.info("fleet: dropped %s at %s", node, peer.endpoint)

    async def withdraw(self) -> None:
        """At a clean stop: delete this daemon's membership, so the others drop it at once."""
        if self.discovery is not None:
            try:
                await asyncio.wait_for(self.discovery.withdraw(), WITHDRAW_S)
            except asyncio.TimeoutError:
                log.info("fleet: membership not withdrawn in %.0f s; it expires", WITHDRAW_S)

    async def close(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.peer_reads is not None:
            await self.peer_reads.close()  # its reads' threads out of NIXL before the agent and G2 go
        if self.p2p_server is not None:
            self.p2p_server.close()
        if self._agent is not None:
            self._agent.close()

    def _learn_probed(self, found: dict[BlockKey, int]) -> None:
        with self.publisher.learned():
            self.manager.index.learn(self.shared, found)

    def _apply_peer(self, peer: PeerFollower, batch: p.EventBatch) -> None:
        """A peer's G4 stores and removals are this daemon's too (same bucket, same keys); its G2/G3 ones are
        what it could serve a peer read from (:class:`~kvbm.fleet.peers.Residency`); the rest is its own."""
        for ev in batch.events:
            if ev.tier in Residency.TIERS and not isinstance(ev, p.BlocksOnboarded):
                keys = [BlockKey(ev.namespace, h) for h in ev.hashes]
                if isinstance(ev, p.BlocksStored):
                    peer.residency.stored(ev.tier, keys)
                else:
                    peer.residency.removed(ev.tier, keys)
        if not self.shared:
            return
        with self.publisher.learned():
            for ev in batch.events:
                if ev.tier != self.shared or isinstance(ev, p.BlocksOnboarded):
                    continue
                keys = [BlockKey(ev.namespace, h) for h in ev.hashes]
                if isinstance(ev, p.BlocksStored):
                    if self.probe is not None:
                        for k in keys:
                            self.probe.negative.discard(k)
                    if ev.nbytes > 0:  # else (a peer that does not say) the next lookup's probe finds them
                        self.manager.index.learn(self.shared, dict.fromkeys(keys, ev.nbytes))
                    peer.stats.stored += len(keys)
                else:
                    self.manager.index.forget(self.shared, keys)
                    peer.stats.removed += len(keys)

    def _peer_gap(self, _peer: PeerFollower) -> None:
        """Messages from a peer were lost: the blocks they announced may sit in the negative cache."""
        if self.probe is not None:
            self.probe.negative.clear()

    def _peer_curve(self, curve_keys: tuple[str, str], announced: str = "") -> tuple[str, str, str] | None:
        """CURVE for following peers: their PUB's public key (``announced`` in a membership, else
        ``peer_curve_server_key``, else this daemon's own: a fleet sharing one server key pair) and this
        daemon's key pair as the client's (an ephemeral one when it has none; a peer with a client allow-list
        must list this daemon's public key)."""
        own_public, own_secret = curve_keys
        server = announced or self.dc.peer_curve_server_key or own_public
        if not server:
            return None
        if own_secret and own_public:
            return server, own_public, own_secret
        public, secret = zmq.curve_keypair()
        return server, public.decode(), secret.decode()

    def describe(self) -> dict[str, Any]:
        """What ``kvbm status`` shows of the fleet: peers followed, probe counters, negative-cache size."""
        return {
            "shared_tier": self.shared or None,
            "peers": [peer.describe() for peer in self.peers],
            "probe": self.probe.describe() if self.probe is not None else None,
            "discovery": self.discovery.describe() if self.discovery is not None else None,
            "p2p": None if self.peer_reads is None else {
                "error": self.p2p_error,
                "serve": self.p2p_server.describe() if self.p2p_server is not None else None,
                "read": self.peer_reads.describe(),
            },
        }


def read_peer_token(dc: DaemonConfig) -> str:
    """What this daemon presents to a peer's events socket that has tenants and no CURVE (PLAIN, user
    ``admin``): the token in ``daemon.peer_token_file`` (the peers' admin token); "" when none is configured.
    Never this daemon's own admin token by default: anyone who can write the bucket prefix can announce an
    endpoint, and PLAIN sends the token in clear. Blocking file read: call it in a thread."""
    return read_token_file(dc.peer_token_file, "daemon.peer_token_file")


def announced_endpoint(dc: DaemonConfig, bound: str) -> str:
    """What the others connect to: ``daemon.announce_endpoint``, else the bound endpoint with a wildcard
    address replaced by this host's name."""
    if dc.announce_endpoint:
        return dc.announce_endpoint
    return wildcard_to_host(bound)


def wildcard_to_host(bound: str) -> str:
    """``bound`` with a wildcard address replaced by this host's name (what another host can dial)."""
    for wild in ("0.0.0.0", "[::]", "*"):
        if f"//{wild}:" in bound:
            return bound.replace(f"//{wild}:", f"//{socket.getfqdn()}:")
    return bound
