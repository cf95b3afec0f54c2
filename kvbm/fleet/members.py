"""Discovery: daemons sharing a bucket announce themselves in it and follow each other without a peer list.

Each daemon keeps one small JSON object, ``{s3.prefix}/_members/{node}.json`` (a :class:`Membership`: node
id, event endpoint, CURVE public key, expiry), rewritten every ``discovery_ttl_s / 3`` and deleted when the
daemon stops cleanly. Every ``discovery_interval_s`` it lists ``_members/``, reads the objects and reports
the live ones to the daemon (``join``), and the ones that vanished or expired (``leave``).

A member counts as expired when its ``expires_at`` (the writer's clock) has passed on the reader's clock, or
when its ``seq`` has not moved for one TTL as this reader saw it (a writer whose clock runs ahead). Clocks
must therefore agree to well within the TTL (NTP does). A failed LIST or GET changes nothing: members are
dropped only on what the bucket says, never because the bucket could not be asked.

``_members`` is not a namespace (namespaces start with a letter or digit), so block listings skip it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvbm.errors import TierUnavailableError
from kvbm.recency import node_name

log = logging.getLogger(__name__)

MEMBERS_DIR = "_members"
MEMBER_SUFFIX = ".json"
MEMBERSHIP_VERSION = 1
MAX_MEMBER_BYTES = 4096  # a membership object is ~300 bytes; anything larger is not one


class Membership(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """One node's announcement (JSON in the bucket). Unknown fields are ignored: newer writers may add some."""

    v: int = MEMBERSHIP_VERSION
    node_id: str
    instance: str  # random per daemon process: tells two daemons claiming one node id apart
    events_endpoint: str
    curve_public_key: str = ""  # Z85; empty: its PUB socket is plain
    started_at: float
    updated_at: float
    expires_at: float
    seq: int = 0  # bumped at every refresh


def members_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{MEMBERS_DIR}/" if prefix else f"{MEMBERS_DIR}/"


def member_key(prefix: str, node: str) -> str:
    return f"{members_prefix(prefix)}{node}{MEMBER_SUFFIX}"


def is_member_key(prefix: str, okey: str) -> bool:
    return okey.startswith(members_prefix(prefix))


def decode_member(body: bytes) -> Membership | None:
    """The membership in ``body``, or None when it is not a readable one of this version."""
    if len(body) > MAX_MEMBER_BYTES:
        return None
    try:
        m = msgspec.json.decode(body, type=Membership)
    except msgspec.DecodeError:
        return None
    return m if m.v == MEMBERSHIP_VERSION and m.events_endpoint and m.node_id else None


class DiscoveryStats(msgspec.Struct):
    announces: int = 0  # membership objects written
    scans: int = 0  # listings of the members directory
    failed: int = 0  # announces or scans that could not reach the bucket
    joined: int = 0  # members reported new (or changed: another endpoint or key)
    left: int = 0  # members reported gone (object deleted) or expired
    bad: int = 0  # objects under _members/ that are not memberships
    conflicts: int = 0  # another daemon announced this node's id
    last_scan_at: float = 0.0  # unix time of the last successful scan


class Discovery:
    """Announce this node and watch the others; see the module docstring.

    ``tier`` is the shared S3 tier (``put_aux``/``get_aux``/``_list_pages``/``delete_many``); ``join(m)`` is
    called for a member to follow (again, when its endpoint or key changed), ``leave(node)`` for one to drop."""

    def __init__(self, tier: Any, node_id: str, events_endpoint: str, curve_public_key: str, *,
                 join: Callable[[Membership], None], leave: Callable[[str], None], interval_s: float = 2.0,
                 ttl_s: float = 15.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.node = node_name(node_id)
        self.key = member_key(tier.prefix, self.node)
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.refresh_s = ttl_s / 3
        self._join = join
        self._leave = leave
        self._clock = clock
        self._mono = monotonic
        now = clock()
        self.me = Membership(node_id=self.node, instance=secrets.token_hex(8), events_endpoint=events_endpoint,
                             curve_public_key=curve_public_key, started_at=now, updated_at=now,
                             expires_at=now + ttl_s)
        self.members: dict[str, Membership] = {}  # followed: node -> its last membership
        self._moved: dict[str, tuple[int, float]] = {}  # node -> (seq, monotonic time this reader saw it change)
        self._next_announce = 0.0
        self.stats = DiscoveryStats()

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.interval_s)

    async def step(self) -> None:
        """Announce if due, then scan. Never raises for an unreachable bucket (counted, retried next step)."""
        if self._mono() >= self._next_announce:
            await self.announce()
        await self.scan()

    async def announce(self) -> bool:
        now = self._clock()
        self.me.seq += 1
        self.me.updated_at = now
        self.me.expires_at = now + self.ttl_s
        try:
            await self.tier.put_aux(self.key, msgspec.json.encode(self.me))
        except TierUnavailableError as e:
            self.stats.failed += 1
            log.debug("discovery: announce failed: %s", e)
            self._next_announce = self._mono() + min(self.interval_s, self.refresh_s)
            return False
        self.stats.announces += 1
        self._next_announce = self._mono() + self.refresh_s
        return True

    async def withdraw(self) -> None:
        """Delete this node's membership (a clean stop), so the others drop it at their next scan."""
        try:
            await self.tier.delete_many([self.key])
        except TierUnavailableError as e:
            log.info("discovery: membership %s not withdrawn (it expires in %.0f s): %s", self.key, self.ttl_s, e)

    async def read_all(self) -> dict[str, Membership] | None:
        """Every readable membership under ``_members/`` (own included), or None when the bucket cannot tell."""
        okeys: list[str] = []
        try:
            async for page in self.tier._list_pages(members_prefix(self.tier.prefix)):
                okeys.extend(okey for _bk, okey, size, _mt in page
                             if okey.endswith(MEMBER_SUFFIX) and 0 < size <= MAX_MEMBER_BYTES)
            bodies = await asyncio.gather(*(self.tier.get_aux(k) for k in okeys))
        except TierUnavailableError as e:
            log.debug("discovery: scan failed: %s", e)
            return None
        out: dict[str, Membership] = {}
        for okey, body in zip(okeys, bodies, strict=True):
            if body is None:  # deleted between the LIST and the GET: gone
                continue
            m = decode_member(body)
            if m is None or member_key(self.tier.prefix, m.node_id) != okey:
                self.stats.bad += 1
                continue
            out[m.node_id] = m
        return out

    def expired(self, m: Membership) -> bool:
        now_mono = self._mono()
        seq, since = self._moved.get(m.node_id, (-1, now_mono))
        if m.seq != seq:
            self._moved[m.node_id] = (m.seq, now_mono)
            since = now_mono
        ttl = max(m.expires_at - m.updated_at, 0.0)
        return self._clock() >= m.expires_at or now_mono - since > ttl

    async def scan(self) -> bool:
        found = await self.read_all()
        if found is None:
            self.stats.failed += 1
            return False
        self.stats.scans += 1
        self.stats.last_scan_at = self._clock()
        own = found.pop(self.node, None)
        if own is not None and own.instance != self.me.instance:
            self.stats.conflicts += 1
            log.warning("discovery: node id %r is also announced by another daemon (events %s); give each daemon "
                        "its own daemon.node_id", self.node, own.events_endpoint)
            self._next_announce = 0.0  # put ours back: a fleet of two claimants flaps, and says so
        live = {n: m for n, m in found.items() if not self.expired(m)}
        for node in [n for n in self.members if n not in live]:
            del self.members[node]
            self.stats.left += 1
            self._leave(node)
        for node, m in live.items():
            old = self.members.get(node)
            self.members[node] = m
            if old is None or (old.events_endpoint, old.curve_public_key, old.instance) != (
                    m.events_endpoint, m.curve_public_key, m.instance):
                self.stats.joined += 1
                self._join(m)
        for node in [n for n in self._moved if n not in found]:
            del self._moved[node]
        return True

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = msgspec.structs.asdict(self.stats)
        d.update(node=self.node, key=self.key, events_endpoint=self.me.events_endpoint, members=sorted(self.members),
                 interval_s=self.interval_s, ttl_s=self.ttl_s)
        return d
