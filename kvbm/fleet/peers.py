"""Peer followers: subscribe to other daemons' event streams (their ``daemon.events_endpoint``) and hand their
batches to the daemon, which learns their G4 stores and removals at once.

Every daemon numbers its batches (an 8-byte big-endian sequence, from 0 at start). A follower checks the
numbers: a jump forward means messages were lost (a slow joiner, a full queue), a step back means the peer
restarted and counts from 0 again. Either way the follower keeps going and tells the daemon (``on_gap``),
which forgets its negative cache so the bucket probe finds whatever the lost messages announced. ZeroMQ
reconnects the SUB socket on its own when a peer dies and comes back.

A follower authenticates with CURVE (the peer's server key) or, to a daemon with tenants and no CURVE, with
ZeroMQ PLAIN (``plain``: user and the peer's admin token). A handshake the peer refuses is not retried silently:
``error`` in its stats (and ``kvbm status``) says why, until a connection succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.fleet.p2p import HELLO_TOPIC, P2P_VERSION, Hello, decode_hello

log = logging.getLogger(__name__)

_UP_EVENT = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)  # CURVE: up once the handshake passed
_FAILED_AUTH = getattr(zmq, "EVENT_HANDSHAKE_FAILED_AUTH", 0)  # the peer's ZAP handler refused us
_FAILED_PROTOCOL = getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", 0)  # e.g. it asks for another mechanism
_FAILED_NO_DETAIL = getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", 0)  # e.g. a wrong CURVE server key
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


class PeerStats(msgspec.Struct):
    endpoint: str
    node_id: str = ""  # the member's node id when discovery found it; "" for a daemon.peers entry
    connected: bool = False
    connects: int = 0  # times the connection (re)started
    batches: int = 0
    stored: int = 0  # G4 blocks learned from the peer's events
    removed: int = 0  # G4 blocks dropped because of them
    gaps: int = 0  # jumps in the peer's sequence numbers (messages lost)
    lost: int = 0  # batches lost in those jumps
    resets: int = 0  # sequence numbers that started again (the peer restarted)
    bad: int = 0  # messages that did not decode
    last_seq: int = -1
    last_event_at: float = 0.0  # unix time of the last batch
    failures: int = 0  # handshakes the peer refused (or that failed)
    error: str = ""  # why the last handshake failed; "" once one succeeds
    resident: int = 0  # its G2/G3 blocks known from its events (what a peer read may ask it for)
    p2p_endpoint: str = ""  # its peer-read socket, from its Hello ("" : it serves no peer reads)


class Residency:
    """Which blocks a peer holds in its G2 and G3, learned from its events: hints for peer reads (a stale one
    costs a refused pin, never wrong bytes: every block read is checksummed)."""

    TIERS = ("G2", "G3")

    def __init__(self) -> None:
        self._held: dict[str, set[BlockKey]] = {t: set() for t in self.TIERS}

    def stored(self, tier: str, keys: list[BlockKey]) -> None:
        self._held[tier].update(keys)

    def removed(self, tier: str, keys: list[BlockKey]) -> None:
        self._held[tier].difference_update(keys)

    def holds(self, key: BlockKey) -> bool:
        return any(key in held for held in self._held.values())

    def clear(self) -> None:
        for held in self._held.values():
            held.clear()

    def __len__(self) -> int:
        return len(self._held["G2"] | self._held["G3"])


class PeerFollower:
    """Follows one peer's PUB socket; ``apply(self, batch)`` for each batch, ``on_gap(self)`` after lost ones."""

    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context, apply: Callable[[PeerFollower, p.EventBatch], None],
                 on_gap: Callable[[PeerFollower], None], *, curve: tuple[str, str, str] | None = None,
                 plain: tuple[str, str] | None = None, node_id: str = "", withheld: str = "") -> None:
        self.endpoint = endpoint
        self._withheld = withheld  # why no credential is presented though the peer may ask for one
        self.stats = PeerStats(endpoint=endpoint, node_id=node_id)
        self._ctx = ctx
        self._apply = apply
        self._on_gap = on_gap
        self._curve = curve  # (server public key, own public key, own secret key), Z85
        self._plain = plain if curve is None else None  # (user, password): a peer with tenants and no CURVE
        self._sock: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._seen = False
        self.residency = Residency()
        self.hello: Hello | None = None  # its last Hello (peer reads), None until one arrives

    @property
    def curve(self) -> tuple[str, str, str] | None:
        """(server public key, own public key, own secret key) this follower connects with: what a peer read's
        socket to the same peer uses too."""
        return self._curve

    def open(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._curve is not None:
            server, public, secret = self._curve
            sock.curve_serverkey = server.encode()
            sock.curve_publickey = public.encode()
            sock.curve_secretkey = secret.encode()
        elif self._plain is not None:
            sock.plain_username = self._plain[0].encode()
            sock.plain_password = self._plain[1].encode()
        sock.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
        self._sock = sock
        try:
            self._mon = sock.get_monitor_socket(_UP_EVENT | zmq.EVENT_DISCONNECTED | _FAILED_AUTH | _FAILED_PROTOCOL
                                                | _FAILED_NO_DETAIL)
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            self.close()  # an endpoint ZeroMQ refuses: no socket left open behind the error
            raise

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (self._mon, self._sock):
            if s is not None:
                s.close(0)
        self._sock = self._mon = None

    async def run(self) -> None:
        await asyncio.gather(self._receive(), self._watch())

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self.handle(frames)
            except Exception:  # one bad batch must not stop the follower
                self.stats.bad += 1
                log.exception("peer %s: batch not applied", self.endpoint)

    async def _watch(self) -> None:
        """Connection state from the socket monitor (what ``kvbm status`` shows)."""
        assert self._mon is not None
        while True:
            ev: dict[str, Any] = parse_monitor_message(await self._mon.recv_multipart())
            if ev["event"] == _UP_EVENT:
                self.stats.connected = True
                self.stats.connects += 1
                self.stats.error = ""
                self._on_gap(self)  # whatever it published before this connection is lost to us
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.connected = False
            elif ev["event"] in (_FAILED_AUTH, _FAILED_PROTOCOL, _FAILED_NO_DETAIL):
                self.stats.connected = False
                self.stats.failures += 1
                why = self._why(ev["event"], int(ev.get("value") or 0))
                if why != self.stats.error:
                    log.warning("peer %s: cannot follow it: %s", self.endpoint, why)
                self.stats.error = why

    def _why(self, event: int, value: int) -> str:
        """What a failed handshake means for the operator (what ``kvbm status`` shows)."""
        if event == _FAILED_AUTH:
            if self._plain is not None:
                return (f"the peer refused the token (ZAP {value}): daemon.peer_token_file must hold the peer's "
                        "admin token")
            return f"the peer refused this daemon's CURVE key (ZAP {value}): add it to the peer's curve_clients_dir"
        if self._withheld and self._curve is None and self._plain is None:
            return self._withheld
        if event == _FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
            if self._curve is None and self._plain is None:
                return ("the peer's events socket needs a credential (a daemon with tenants and no CURVE): set "
                        "daemon.peer_token_file to a file holding its admin token")
            if self._plain is not None:
                return ("this daemon presents the peer token (PLAIN) but the peer's events socket does not ask for "
                        "it (a daemon without tenants?): list only the peers that do in daemon.peer_token_endpoints "
                        "(static peers get the token when that list is empty)")
            return "the peer's events socket uses another security mechanism (CURVE on one side only?)"
        if event == _FAILED_PROTOCOL:
            return f"handshake failed: ZMTP protocol error {value:#x}"
        if self._curve is None and self._plain is None:
            # Seen for a daemon with tenants and no CURVE too (its PLAIN socket drops a NULL peer without a word).
            return ("handshake failed (no detail): the peer's events socket may need a credential (daemon."
                    "peer_token_file, for a daemon with tenants and no CURVE) or CURVE (daemon.peer_curve_server_key)")
        if self._plain is not None:  # a NULL socket answers PLAIN with a mismatch or, as often, no detail
            return ("handshake failed (no detail) presenting the peer token (PLAIN): a peer without tenants does not "
                    "ask for it: list only the peers that do in daemon.peer_token_endpoints (static peers get the "
                    "token when that list is empty)")
        return "handshake failed (no detail: a wrong CURVE server key, daemon.peer_curve_server_key?)"

    def handle(self, frames: list[bytes]) -> None:
        """One published message: ``[topic, seq (8 bytes), EventBatch]``, or ``[HELLO_TOPIC, Hello]``."""
        if len(frames) == 2 and frames[0] == HELLO_TOPIC:
            self._hello(frames[1])
            return
        if len(frames) != 3 or frames[0] != p.EVENTS_TOPIC or len(frames[1]) != 8:
            self.stats.bad += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.stats.last_seq
        gap = False
        if not self._seen:
            gap = seq > 0  # joined late (or the peer published before we connected)
            self._seen = True
        elif seq > last + 1:
            self.stats.gaps += 1
            self.stats.lost += seq - last - 1
            gap = True
        elif seq <= last:
            self.stats.resets += 1
            self.residency.clear()  # a restarted peer's G2 is a new pool
            gap = True  # what it published between dying and our reconnect is lost
        self.stats.last_seq = seq
        if gap:
            self._on_gap(self)
        try:
            batch = p.decode_events(frames[2])
        except p.ProtocolError as e:
            self.stats.bad += 1
            log.warning("peer %s: %s", self.endpoint, e)
            return
        if batch.v != p.PROTOCOL_VERSION:
            self.stats.bad += 1
            return
        self.stats.batches += 1
        self.stats.last_event_at = time.time()
        self._apply(self, batch)

    def _hello(self, buf: bytes) -> None:
        try:
            hello = decode_hello(buf)
        except msgspec.DecodeError:
            self.stats.bad += 1
            return
        if hello.v != P2P_VERSION:
            self.stats.bad += 1
            return
        if self.hello is not None and hello.instance != self.hello.instance:
            self.residency.clear()  # another process: what the old one held is gone
        self.hello = hello
        self.stats.p2p_endpoint = hello.endpoint

    def describe(self) -> dict[str, object]:
        self.stats.resident = len(self.residency)
        return msgspec.structs.asdict(self.stats)
