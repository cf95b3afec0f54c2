"""The daemon's part in a fleet (see :mod:`kvbm.fleet`): what other daemons sharing the bucket store and delete.

It owns the bucket probe and the peer followers, and applies what they learn to the manager's index of the
shared tier, inside :meth:`EventPublisher.learned` so it is not republished.
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.config import DaemonConfig
from kvbm.daemon.events import EventPublisher
from kvbm.daemon.transport import Spawn
from kvbm.fleet import BucketProbe, PeerFollower
from kvbm.manager import BlockManager
from kvbm.tiers.s3 import S3Tier


def shared_tier(manager: BlockManager) -> S3Tier | None:
    return next((t for t in manager.tiers if isinstance(t, S3Tier)), None)


class FleetMember:
    """Bucket probe plus peer followers, wired to the manager's index of the shared tier."""

    def __init__(self, dc: DaemonConfig, manager: BlockManager, publisher: EventPublisher) -> None:
        self.dc = dc
        self.manager = manager
        self.publisher = publisher
        shared = shared_tier(manager)
        self.shared = shared.name if shared is not None else ""
        self.probe: BucketProbe | None = None
        if shared is not None and dc.probe:
            self.probe = BucketProbe(shared, self._learn_probed, concurrency=dc.probe_concurrency,
                                     max_blocks=dc.probe_max_blocks, negative_ttl_s=dc.probe_negative_ttl_s,
                                     negative_max=dc.probe_negative_max)
        self.peers: list[PeerFollower] = []

    def follow(self, ctx: zmq.asyncio.Context, curve_keys: tuple[str, str], spawn: Spawn) -> None:
        """Open a follower per ``daemon.peers`` endpoint."""
        for ep in self.dc.peers:
            peer = PeerFollower(ep, ctx, self._apply_peer, self._peer_gap, curve=self._peer_curve(curve_keys))
            peer.open()
            self.peers.append(peer)
            spawn(peer.run())

    def close(self) -> None:
        for peer in self.peers:
            peer.close()

    def _learn_probed(self, found: dict[BlockKey, int]) -> None:
        with self.publisher.learned():
            self.manager.index.learn(self.shared, found)

    def _apply_peer(self, peer: PeerFollower, batch: p.EventBatch) -> None:
        """A peer's G4 stores and removals are this daemon's too (same bucket, same keys); the rest is its own."""
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

    def _peer_curve(self, curve_keys: tuple[str, str]) -> tuple[str, str, str] | None:
        """CURVE for following peers: their PUB's public key (``peer_curve_server_key``, else this daemon's own:
        a fleet sharing one server key pair) and this daemon's key pair as the client's (an ephemeral one when
        it has none; a peer with a client allow-list must list this daemon's public key)."""
        own_public, own_secret = curve_keys
        server = self.dc.peer_curve_server_key or own_public
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
        }
