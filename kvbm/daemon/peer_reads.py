"""The asking side of peer reads: a lookup whose blocks this daemon holds only in the bucket (or not at all)
while a followed peer holds them in its G2/G3 reads them from that peer's G2 into its own, over NIXL.

For the leading run of such blocks (as far as one peer holds them, at most ``fleet.peer_read_max_blocks``) it
connects to the peer's peer-read socket (announced in the peer's Hello on its events stream; NIXL agent
metadata is exchanged there on first contact, never through the bucket), asks it to pin them
(:mod:`kvbm.daemon.peer_serve`), reserves its own G2 slots, READs the peer's slots into them (one-sided), checks
each block's xxh3-64 against the peer's (a mismatch is a miss: the slot is given back, the block read elsewhere),
commits the good ones and unpins. The lookup waits for this at most ``fleet.peer_read_budget_ms``; then it
answers with what it has (the bucket's copy, or a recompute) and a read still running fills G2 for the next
lookup, like a late bucket probe. A peer that refuses, stops or dies costs that wait at most; every slot this
side reserved is released whatever happens, and the peer's pin expires on its own (``peer_read_lease_ms``).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash
import zmq
import zmq.asyncio

from kvbm.blocks import BlockKey
from kvbm.config.fleet import FleetConfig
from kvbm.daemon.logs import logj
from kvbm.errors import KvbmError
from kvbm.fleet import p2p as m
from kvbm.fleet.peers import PeerFollower
from kvbm.manager.core import BlockManager
from kvbm.security import read_token_file
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier
from kvbm.transfer.peer import PeerAgent

log = logging.getLogger(__name__)
COOLDOWN_S = 1.0  # a peer whose read failed (no reply, no connection) is not asked again for this long
LOCAL_ENOUGH = frozenset({TierName.G1, TierName.G2, TierName.G3})  # held here: no reason to ask a peer


class PeerRefused(KvbmError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ReadStats(msgspec.Struct):
    reads: int = 0  # peer reads started
    blocks: int = 0  # blocks read byte-exact from peers into G2
    bytes: int = 0
    checksum_failures: int = 0  # blocks whose bytes did not match the peer's checksum: misses
    refused: int = 0  # reads a peer refused (forbidden, busy, ...)
    failed: int = 0  # reads that failed (no reply in time, a transfer error: a stopped or dead peer)
    late: int = 0  # lookups that answered before their peer read was done (the budget ran out)
    reading_slots: int = 0  # own G2 slots reserved for reads in flight now
    pin_seconds: float = 0.0  # from asking to the peer's Pinned (a first contact's Connect included)
    read_seconds: float = 0.0  # in NIXL READs
    verify_seconds: float = 0.0  # checksumming what was read


class _Link:
    """One peer's peer-read socket: a DEALER, requests matched to replies by id."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, instance: str,
                 curve: tuple[str, str, str] | None) -> None:
        self.endpoint = endpoint
        self.instance = instance
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing to a peer that is not connected: fail at once
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_P2P_MESSAGE)
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (k.encode() for k in curve)
        sock.connect(endpoint)
        self.sock = sock
        self.remote: m.Connected | None = None
        self.remote_name = ""
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._drops: set[asyncio.Task[None]] = set()
        self.lock = asyncio.Lock()  # one Connect at a time

    async def request(self, msg: msgspec.Struct, timeout_s: float) -> Any:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            t0 = time.monotonic()
            try:  # IMMEDIATE: the send waits for a connection (a new link's, or a peer that came back)
                await asyncio.wait_for(self.sock.send_multipart([rid.to_bytes(8, "big"), m.encode(msg)]), timeout_s)
            except asyncio.TimeoutError as e:
                raise OSError(errno.ECONNREFUSED, f"peer {self.endpoint}: no connection in {timeout_s:.3g} s") from e
            reply = await asyncio.wait_for(fut, max(0.0, timeout_s - (time.monotonic() - t0)))
        except asyncio.TimeoutError as e:
            raise OSError(errno.ETIMEDOUT, f"peer {self.endpoint}: no reply within {timeout_s:.3g} s") from e
        finally:
            self._waiting.pop(rid, None)
        if isinstance(reply, m.Refused):
            raise PeerRefused(reply.code, reply.message)
        return reply

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue
            rid = int.from_bytes(frames[0], "big")
            try:
                reply = m.decode_reply(frames[1])
            except msgspec.DecodeError:
                continue
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
            elif isinstance(reply, m.Pinned) and reply.lease:
                # A pin answered after we gave up on it (a peer that was stopped): give it back now.
                task = asyncio.ensure_future(self._drop(reply.lease))
                self._drops.add(task)
                task.add_done_callback(self._drops.discard)

    async def _drop(self, lease: int) -> None:
        try:
            await self.request(m.Unpin(lease=lease), 5.0)
        except (OSError, KvbmError):
            pass

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self.sock.close(0)


class PeerReads:
    """Fills a lookup's bucket-only (or missing) blocks from a peer's G2 (see the module doc)."""

    def __init__(self, fc: FleetConfig, manager: BlockManager, peers: Callable[[], Sequence[PeerFollower]],
                 node_id: str) -> None:
        self.fc = fc
        self.manager = manager
        self._peers = peers
        self.node_id = node_id
        self.stats = ReadStats()
        self.per_peer: dict[str, dict[str, int]] = {}  # node (or endpoint) -> blocks, bytes, refused, failed
        self.agent: PeerAgent | None = None
        self.token = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._curve: Callable[[PeerFollower], tuple[str, str, str] | None] = lambda _p: None
        self._links: dict[str, _Link] = {}
        self._reading: dict[BlockKey, asyncio.Task[int]] = {}
        self._stalled: dict[str, int] = {}  # peer endpoint -> its reads still running past a lookup's budget
        self._late: set[asyncio.Task[int]] = set()
        self._owner: dict[asyncio.Task[int], str] = {}  # a read in flight -> its peer's endpoint
        self._cooldown: dict[str, float] = {}  # peer endpoint -> when it may be asked again after a failure

    def start(self, ctx: zmq.asyncio.Context, agent: PeerAgent, token: str,
              curve: Callable[[PeerFollower], tuple[str, str, str] | None]) -> None:
        self._ctx, self.agent, self.token, self._curve = ctx, agent, token, curve

    @property
    def g2(self) -> SlotPoolTier:
        tier = self.manager.by_name[TierName.G2]
        assert isinstance(tier, SlotPoolTier)
        return tier

    # -- the lookup hook ---------------------------------------------------------------------------------
    async def fill(self, namespace: str, hashes: Sequence[bytes], tiers: list[str]) -> list[str]:
        """``tiers`` (a lookup's leading run) after reading from a peer what it holds in G2/G3 and this daemon
        only in the bucket or nowhere, waiting at most ``peer_read_budget_ms``."""
        if self.agent is None:
            return tiers
        start = next((i for i, t in enumerate(tiers) if t not in LOCAL_ENOUGH), len(tiers))
        if start >= len(hashes):
            return tiers
        first = BlockKey(namespace, hashes[start])
        task = self._reading.get(first)
        if task is None:
            now = time.monotonic()
            peer = next((pf for pf in self._peers() if pf.hello is not None and pf.stats.connected
                         and not self._stalled.get(pf.endpoint) and self._cooldown.get(pf.endpoint, 0.0) <= now
                         and pf.residency.holds(first)), None)
            if peer is None:
                return tiers
            keys = [first]
            for i in range(start + 1, min(len(hashes), start + self.fc.peer_read_max_blocks)):
                k = BlockKey(namespace, hashes[i])
                if (i < len(tiers) and tiers[i] in LOCAL_ENOUGH) or not peer.residency.holds(k):
                    break
                keys.append(k)
            task = asyncio.ensure_future(self._read(peer, keys))
            self._owner[task] = peer.endpoint
            for k in keys:
                self._reading[k] = task
            task.add_done_callback(lambda _t, ks=keys: self._done(ks, _t))
        if task in self._late:  # already past another lookup's budget: do not wait for it again
            self.stats.late += 1
            return tiers
        budget = self.fc.peer_read_budget_ms / 1000
        if budget > 0:
            await asyncio.wait({task}, timeout=budget)
        if not task.done():
            # Until this read ends, other lookups do not wait on this peer (it is stopped, or slow): the bucket.
            self.stats.late += 1
            ep = self._owner.get(task, "")
            if ep and task not in self._late:
                self._late.add(task)
                self._stalled[ep] = self._stalled.get(ep, 0) + 1
                task.add_done_callback(lambda _t, e=ep: self._unstall(e, _t))
            return tiers
        keys_all = [BlockKey(namespace, h) for h in hashes]
        return self.manager.held_run(keys_all)

    def _unstall(self, endpoint: str, task: asyncio.Task[int]) -> None:
        self._late.discard(task)
        n = self._stalled.get(endpoint, 0) - 1
        if n > 0:
            self._stalled[endpoint] = n
        else:
            self._stalled.pop(endpoint, None)

    def _done(self, keys: list[BlockKey], task: asyncio.Task[int]) -> None:
        self._owner.pop(task, None)
        for k in keys:
            if self._reading.get(k) is task:
                del self._reading[k]
        if not task.cancelled() and task.exception() is not None:
            log.debug("peer read failed: %s", task.exception())

    # -- one read ----------------------------------------------------------------------------------------
    def _count(self, peer: PeerFollower, field: str, n: int = 1) -> None:
        name = peer.stats.node_id or (peer.hello.node_id if peer.hello else "") or peer.endpoint
        c = self.per_peer.setdefault(name, {"blocks": 0, "bytes": 0, "refused": 0, "failed": 0,
                                            "checksum_failures": 0})
        c[field] += n

    async def _link(self, peer: PeerFollower) -> _Link:
        hello = peer.hello
        assert hello is not None and self._ctx is not None and self.agent is not None
        link = self._links.get(peer.endpoint)
        if link is not None and (link.instance != hello.instance or link.endpoint != hello.endpoint):
            self._forget(peer.endpoint)  # the peer restarted: its agent and pins are gone
            link = None
        if link is None:
            link = self._links[peer.endpoint] = _Link(self._ctx, hello.endpoint, hello.instance, self._curve(peer))
        async with link.lock:
            if link.remote is None:
                meta = await asyncio.to_thread(self.agent.metadata)
                got: m.Connected = await link.request(
                    m.Connect(node_id=self.node_id, agent=meta, token=self.token), self.fc.peer_read_lease_ms / 1000)
                link.remote_name = await asyncio.to_thread(self.agent.add_remote, got.agent)
                link.remote = got
                logj("p2p.linked", peer=hello.node_id, endpoint=hello.endpoint, agent=got.agent_name)
        return link

    def _forget(self, endpoint: str) -> None:
        link = self._links.pop(endpoint, None)
        if link is not None:
            if link.remote_name and self.agent is not None:
                self.agent.remove_remote(link.remote_name)
            link.close()

    async def _read(self, peer: PeerFollower, keys: list[BlockKey]) -> int:
        """Read ``keys`` from ``peer`` into G2; returns blocks committed. Never leaves a slot reserved."""
        self.stats.reads += 1
        t0 = time.monotonic()
        try:
            link = await self._link(peer)
            pinned: m.Pinned = await link.request(m.Pin(namespace=keys[0].namespace, hashes=[k.hash for k in keys]),
                                                  self.fc.peer_read_lease_ms / 1000)
        except PeerRefused as e:
            self.stats.refused += 1
            self._count(peer, "refused")
            logj("p2p.read_refused", level=logging.WARNING, peer=peer.endpoint, code=e.code, message=str(e))
            return 0
        except OSError as e:
            self.stats.failed += 1
            self._count(peer, "failed")
            self._forget(peer.endpoint)  # a later read connects afresh (the peer may come back another process)
            self._cooldown[peer.endpoint] = time.monotonic() + COOLDOWN_S
            logj("p2p.read_failed", level=logging.WARNING, peer=peer.endpoint, why=str(e))
            return 0
        if not pinned.slots:
            return 0
        self.stats.pin_seconds += time.monotonic() - t0
        try:
            deadline = t0 + pinned.lease_ms / 1000
            return await self._copy(peer, link, keys[: len(pinned.slots)], pinned, deadline)
        finally:
            if pinned.lease:
                try:
                    await link.request(m.Unpin(lease=pinned.lease), max(0.5, self.fc.peer_read_lease_ms / 1000))
                except (OSError, KvbmError):
                    pass  # its lease expires on its own

    async def _copy(self, peer: PeerFollower, link: _Link, keys: list[BlockKey], pinned: m.Pinned,
                    deadline: float) -> int:
        assert self.agent is not None and link.remote is not None
        g2, remote = self.g2, link.remote
        by_size: dict[int, list[int]] = {}
        for i, n in enumerate(pinned.nbytes):
            by_size.setdefault(n, []).append(i)
        mine: dict[int, int] = {}  # index in keys -> own slot
        prepared: list[BlockKey] = []
        try:
            for nbytes, idx in by_size.items():
                slots = await self.manager.prepare_store([keys[i] for i in idx], nbytes, TierName.G2)
                for i, s in zip(idx, slots, strict=True):
                    if s is not None:
                        mine[i] = s
                        prepared.append(keys[i])
            self.stats.reading_slots += len(prepared)
            base = self.agent.pool_addr
            pairs = [(base + s * g2.slot_bytes, remote.pool_addr + pinned.slots[i] * remote.slot_bytes,
                      pinned.nbytes[i]) for i, s in mine.items()]
            t1 = time.monotonic()
            await asyncio.to_thread(self.agent.read, link.remote_name, pairs, max(0.05, deadline - time.monotonic()))
            t2 = time.monotonic()
            good = await asyncio.to_thread(self._verify, mine, pinned)
            self.stats.read_seconds += t2 - t1
            self.stats.verify_seconds += time.monotonic() - t2
        except BaseException as e:
            self.manager.complete_store(prepared, ok=False)
            self.stats.reading_slots -= len(prepared)
            if isinstance(e, (OSError, KvbmError)):
                self.stats.failed += 1
                self._count(peer, "failed")
                logj("p2p.read_failed", level=logging.WARNING, peer=peer.endpoint, why=str(e))
                return 0
            raise
        self.stats.reading_slots -= len(prepared)
        ok = [keys[i] for i in good]
        bad = [keys[i] for i in mine if i not in good]
        self.manager.complete_store(bad, ok=False)
        done = self.manager.complete_store(ok, ok=True, cascade=False) if ok else 0
        nbytes = sum(pinned.nbytes[i] for i in good)
        self.stats.blocks += len(ok)
        self.stats.bytes += nbytes
        self.stats.checksum_failures += len(bad)
        self._count(peer, "blocks", len(ok))
        self._count(peer, "bytes", nbytes)
        if bad:
            self._count(peer, "checksum_failures", len(bad))
            logj("p2p.checksum_mismatch", level=logging.WARNING, peer=peer.endpoint, blocks=len(bad))
        logj("p2p.read", peer=peer.endpoint, blocks=len(ok), bytes=nbytes, bad=len(bad))
        return done

    def _verify(self, mine: dict[int, int], pinned: m.Pinned) -> set[int]:
        g2 = self.g2
        good = set()
        for i, s in mine.items():
            view = np.asarray(g2.slot_tensor(s, pinned.nbytes[i]).numpy())
            if xxhash.xxh3_64_intdigest(memoryview(view)) == pinned.checksums[i]:
                good.add(i)
        return good

    def describe(self) -> dict[str, Any]:
        d = msgspec.structs.asdict(self.stats)
        d["peers"] = self.per_peer
        return d

    def close(self) -> None:
        for t in set(self._reading.values()):
            t.cancel()
        for ep in list(self._links):
            self._forget(ep)


def read_token(fc: FleetConfig) -> str:
    """``fleet.peer_read_token_file``'s token ("" without one). Blocking: call it in a thread."""
    return read_token_file(fc.peer_read_token_file, "fleet.peer_read_token_file")
