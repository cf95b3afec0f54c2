"""Discovery: daemons sharing a bucket announce themselves in it and follow each other without a peer list.

Each daemon keeps one small JSON object, ``{s3.prefix}/_members/{node}.json`` (a :class:`Membership`: node
id, event endpoint, CURVE public key, TTL), PUT again every ``discovery_ttl_s / 3`` and deleted when the
daemon stops cleanly. Every ``discovery_interval_s`` it lists ``_members/`` and reports new members to the
daemon (``join``), and members whose object vanished or stopped being refreshed (``leave``).

The body never changes while a daemon runs, so the LIST alone (key, size, last-modified) says who is there
and who still refreshes: a member is read (GET) when it first appears, when its size changes, and at most once
per TTL otherwise (a restart on another endpoint of the same length); a refresh moves its last-modified. A
member whose last-modified has not moved for one TTL (the writer's, as this reader's monotonic clock sees
it) has expired: only equality of the server's timestamps is used, so no two clocks need to agree. A failed
LIST or GET changes nothing: members are dropped on what the bucket says, never because it could not be asked.
The cost per daemon: one LIST per interval and about one GET per member per TTL.

An endpoint only its own host can reach (``ipc://``, ``inproc://``, a loopback address) is announced with a
warning (set ``daemon.announce_endpoint``), and the membership names the host (:func:`this_host`): a daemon on
another host does not follow it (it would connect to its *own* socket of that name and show the peer joined); it
lists it as ``unreachable`` instead. Daemons on the same host follow each other's local endpoints as before.

``_members`` is not a namespace (namespaces start with a letter or digit), so block listings skip it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
from zmq.utils import z85

from kvbm.errors import TierUnavailableError
from kvbm.fleet.recency import node_name

log = logging.getLogger(__name__)

MEMBERS_DIR = "_members"
MEMBER_SUFFIX = ".json"
MEMBERSHIP_VERSION = 1
MAX_MEMBER_BYTES = 4096  # a membership object is ~300 bytes; anything larger is not one
MAX_IPC_PATH = 107  # sun_path holds 108 bytes with its NUL: ZeroMQ refuses a longer ipc:// path
_TCP = re.compile(r"^tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")


class Membership(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """One node's announcement (JSON in the bucket), the same bytes for the daemon's whole life. Unknown
    fields are ignored: newer writers may add some."""

    v: int = MEMBERSHIP_VERSION
    node_id: str
    instance: str  # random per daemon process: tells a restart, and two daemons claiming one node id, apart
    events_endpoint: str
    curve_public_key: str = ""  # Z85; empty: its PUB socket is plain
    started_at: float  # unix time (informational)
    ttl_s: float  # refreshed every ttl_s / 3; gone when not refreshed for ttl_s
    host: str = ""  # the announcing host (:func:`this_host`); "" from older writers: host unknown
    events_auth: str = ""  # "plain": its events socket lets only its admin token subscribe (tenants, no CURVE)


def this_host() -> str:
    """This host's identity in a membership: its host name and boot id (two machines never share both; two
    containers of one machine have their own host names unless they share the host's network)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def host_local(endpoint: str) -> str:
    """Why only its own host can reach ``endpoint`` ("" when others may): an ipc/inproc socket or a loopback
    address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return f"an {scheme}:// socket exists on its own host only"
    host = rest.rsplit(":", 1)[0].strip("[]").lower() if ":" in rest else rest.lower()
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return f"{host} is a loopback address"
    return ""


def members_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{MEMBERS_DIR}/" if prefix else f"{MEMBERS_DIR}/"


def member_key(prefix: str, node: str) -> str:
    return f"{members_prefix(prefix)}{node}{MEMBER_SUFFIX}"


def is_member_key(prefix: str, okey: str) -> bool:
    return okey.startswith(members_prefix(prefix))


def decode_member(body: bytes) -> Membership | None:
    """The membership in ``body``, or None when it is not a readable one of this version that a follower could
    use (:func:`member_problem`): anyone who can write the bucket prefix writes these, so nothing is trusted."""
    if len(body) > MAX_MEMBER_BYTES:
        return None
    try:
        m = msgspec.json.decode(body, type=Membership)
    except msgspec.DecodeError:
        return None
    return m if m.v == MEMBERSHIP_VERSION and not member_problem(m) else None


def member_problem(m: Membership) -> str:
    """Why ``m`` cannot be followed ("" when it can): an endpoint ZeroMQ would refuse or could not reach, a
    CURVE key that is not one, a TTL that is not a duration, an unknown ``events_auth``."""
    if not m.node_id or node_name(m.node_id) != m.node_id:
        return f"node_id {m.node_id!r} is not a node name"
    ep = m.events_endpoint
    if match := _TCP.match(ep):
        if not 0 < int(match.group(1)) < 65536:
            return f"events_endpoint {ep!r}: port out of range"
    elif ep.startswith("ipc://"):
        if not 0 < len(ep[len("ipc://"):].encode()) <= MAX_IPC_PATH:
            return f"events_endpoint {ep!r}: an ipc path of 1 to {MAX_IPC_PATH} bytes (a Unix socket's limit)"
    else:
        return f"events_endpoint {ep!r} is not tcp://host:port or ipc://path"
    if m.curve_public_key:
        try:
            if len(z85.decode(m.curve_public_key.encode("ascii"))) != 32:
                return "curve_public_key is not a 32-byte key"
        except (ValueError, KeyError, UnicodeEncodeError):
            return "curve_public_key is not Z85"
    if not (0 < m.ttl_s < 1e9):
        return f"ttl_s {m.ttl_s!r} is not a positive duration"
    if m.events_auth not in ("", "plain"):
        return f"events_auth {m.events_auth!r} is neither '' nor 'plain'"
    return ""


class _Seen(msgspec.Struct):
    """One membership object as this reader saw it."""

    size: int
    mtime: object  # the LIST's last-modified: compared for equality only
    moved_at: float  # monotonic time this reader saw mtime change (or the object appear)
    member: Membership | None = None
    read_at: float = 0.0  # monotonic time of the last GET
    ttl_s: float = 0.0  # the member's own TTL, from its body


class DiscoveryStats(msgspec.Struct):
    announces: int = 0  # membership objects written
    scans: int = 0  # listings of the members directory
    failed: int = 0  # announces or scans that could not reach the bucket
    reads: int = 0  # membership objects read (GET)
    joined: int = 0  # members reported new (or changed: another endpoint or key)
    left: int = 0  # members reported gone (object deleted) or expired
    bad: int = 0  # objects under _members/ that are not memberships
    conflicts: int = 0  # another daemon announced this node's id
    unreachable: int = 0  # members of other hosts announcing a host-local endpoint, not followed
    last_scan_at: float = 0.0  # unix time of the last successful scan


class Discovery:
    """Announce this node and watch the others; see the module docstring.

    ``tier`` is the shared S3 tier (``put_aux``/``get_aux``/``list_pages``/``delete_many``); ``join(m)`` is
    called for a member to follow (again, when its endpoint or key changed), ``leave(node)`` for one to drop."""

    def __init__(self, tier: Any, node_id: str, events_endpoint: str, curve_public_key: str, *,
                 join: Callable[[Membership], None], leave: Callable[[str], None], interval_s: float = 2.0,
                 ttl_s: float = 15.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, host: str | None = None,
                 events_auth: str = "") -> None:
        self.tier = tier
        self.node = node_name(node_id)
        self.key = member_key(tier.prefix, self.node)
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.refresh_s = ttl_s / 3
        self._join = join
        self._leave = leave
        self._mono = monotonic
        self.me = Membership(node_id=self.node, instance=secrets.token_hex(8), events_endpoint=events_endpoint,
                             curve_public_key=curve_public_key, started_at=clock(), ttl_s=ttl_s,
                             host=this_host() if host is None else host, events_auth=events_auth)
        self._body = msgspec.json.encode(self.me)
        self._clock = clock
        self.members: dict[str, Membership] = {}  # followed: node -> its membership
        self.unreachable: dict[str, str] = {}  # node -> why it is not followed (another host's local endpoint)
        self._seen: dict[str, _Seen] = {}  # object key -> what the listings and the last GET said
        self._next_announce = 0.0
        self._blind = False  # the last scan failed
        self._writing = asyncio.Lock()
        self._withdrawn = False
        self.stats = DiscoveryStats()

    async def run(self) -> None:
        """Step every ``interval_s``: whatever one step meets (a member that cannot be followed, a bug), the next
        still announces this node and scans, so the fleet neither drops it nor stops finding new members."""
        while True:
            try:
                await self.step()
            except Exception:
                self.stats.failed += 1
                log.exception("discovery: step failed (retried in %.1f s)", self.interval_s)
            await asyncio.sleep(self.interval_s)

    async def step(self) -> None:
        """Announce if due, then scan. Never raises for an unreachable bucket (counted, retried next step)."""
        if self._mono() >= self._next_announce:
            await self.announce()
        await self.scan()

    async def announce(self) -> bool:
        async with self._writing:  # never after (or across) the withdrawal
            if self._withdrawn:
                return False
            try:
                await self.tier.put_aux(self.key, self._body)
            except TierUnavailableError as e:
                return self._announce_failed(e)
        self.stats.announces += 1
        self._next_announce = self._mono() + self.refresh_s
        return True

    def _announce_failed(self, e: TierUnavailableError) -> bool:
        self.stats.failed += 1
        log.debug("discovery: announce failed: %s", e)
        self._next_announce = self._mono() + min(self.interval_s, self.refresh_s)
        return False

    async def withdraw(self) -> None:
        """Delete this node's membership (a clean stop), so the others drop it at their next scan; no announce
        follows it."""
        async with self._writing:
            self._withdrawn = True
            try:
                await self.tier.delete_many([self.key])
            except TierUnavailableError as e:
                log.info("discovery: membership %s not withdrawn (it expires in %.0f s): %s", self.key, self.ttl_s, e)

    async def _list(self) -> dict[str, tuple[int, object]] | None:
        """``{object key: (size, last-modified)}`` under ``_members/``, or None when the bucket cannot tell."""
        out: dict[str, tuple[int, object]] = {}
        try:
            async for page in self.tier.list_pages(members_prefix(self.tier.prefix)):
                for _bk, okey, size, mtime in page:
                    if okey.endswith(MEMBER_SUFFIX):
                        out[okey] = (size, mtime)
        except TierUnavailableError as e:
            log.debug("discovery: scan failed: %s", e)
            return None
        return out

    async def _read(self, okey: str) -> Membership | bool | None:
        """The membership at ``okey``; None when it is gone or not one; False when it could not be read."""
        try:
            body = await self.tier.get_aux(okey)
        except TierUnavailableError as e:
            log.debug("discovery: read of %s failed: %s", okey, e)
            return False
        self.stats.reads += 1
        if body is None:
            return None
        m = decode_member(body)
        if m is None or member_key(self.tier.prefix, m.node_id) != okey:
            self.stats.bad += 1
            log.debug("discovery: %s is not a membership to follow", okey)
            return None
        return m

    async def scan(self) -> bool:
        listed = await self._list()
        if listed is None:
            self.stats.failed += 1
            self._blind = True
            return False
        now = self._mono()
        if self._blind:  # refreshes made while we could not look went unseen: give everyone a fresh TTL
            self._blind = False
            for seen in self._seen.values():
                seen.moved_at = now
        for okey in [k for k in self._seen if k not in listed]:
            del self._seen[okey]
        stale: list[str] = []  # to GET: new, resized, or not read for a TTL
        for okey, (size, mtime) in listed.items():
            seen = self._seen.get(okey)
            if seen is None:
                seen = self._seen[okey] = _Seen(size=size, mtime=mtime, moved_at=now)
                stale.append(okey)
                continue
            if mtime != seen.mtime:
                seen.mtime, seen.moved_at = mtime, now
            if size != seen.size or seen.member is None or now - seen.read_at >= seen.ttl_s:
                seen.size = size
                stale.append(okey)
        got = await asyncio.gather(*(self._read(k) for k in stale))
        for okey, m in zip(stale, got, strict=True):
            if m is False:
                continue  # keep what we knew
            seen = self._seen[okey]
            seen.member, seen.read_at = m or None, now
            if m:
                seen.ttl_s = max(m.ttl_s, 0.0)
        live: dict[str, Membership] = {}
        for okey, seen in self._seen.items():
            m = seen.member
            if m is None or (okey != self.key and now - seen.moved_at > seen.ttl_s):
                continue  # unreadable, or not refreshed for a TTL: expired
            live[m.node_id] = m
        self.stats.scans += 1
        self.stats.last_scan_at = self._clock()
        own = live.pop(self.node, None)
        if own is not None and own.instance != self.me.instance:
            self.stats.conflicts += 1
            log.warning("discovery: node id %r is also announced by another daemon (events %s); give each daemon "
                        "its own daemon.node_id", self.node, own.events_endpoint)
            self._next_announce = 0.0  # put ours back: a fleet of two claimants flaps, and says so
        unreachable: dict[str, str] = {}
        for node, m in list(live.items()):
            why = host_local(m.events_endpoint)
            if why and m.host and m.host != self.me.host:
                unreachable[node] = f"{m.events_endpoint} ({why}; announced by host {m.host})"
                del live[node]
                if node not in self.unreachable:
                    self.stats.unreachable += 1
                    log.warning("discovery: member %s announced %s: %s, not this one; not followed (give it a "
                                "routable daemon.announce_endpoint)", node, m.events_endpoint, why)
        self.unreachable = unreachable
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
                try:
                    self._join(m)
                except Exception as e:  # one member that cannot be followed must not stop following the others
                    self.stats.bad += 1
                    log.warning("discovery: member %s (events %s) not followed: %s", node, m.events_endpoint, e)
        return True

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = msgspec.structs.asdict(self.stats)
        d.update(node=self.node, key=self.key, events_endpoint=self.me.events_endpoint, members=sorted(self.members),
                 interval_s=self.interval_s, ttl_s=self.ttl_s, host=self.me.host,
                 host_local=host_local(self.me.events_endpoint), unreachable_members=dict(self.unreachable))
        return d
