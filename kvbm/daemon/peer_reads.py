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
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq.asyncio

from kvbm.blocks import BlockKey
from kvbm.config.fleet import FleetConfig
from kvbm.daemon.logs import logj
from kvbm.daemon.peer_fetch import Fetcher
from kvbm.daemon.peer_link import Link, Links, PeerRefused
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
# Own slots a READ may still be writing into when it failed (a timeout, a transfer error, a cancel while its thread
# runs) stay referenced this long before reuse: NIXL may not stop a one-sided GET already posted when its handle is
# released, and its bytes landing in a slot another block then holds would be wrong bytes no one checks. (Its READs
# end by the pin's deadline, far sooner.) A peer whose READ failed is not asked for COOLDOWN_S, and no read starts
# while a quarter of G2 is held back so.
QUARANTINE_S = 30.0
CLOSE_WAIT_S = 5.0  # past a read's pin deadline, the longest a close waits for its thread to leave NIXL


class ReadStats(msgspec.Struct):
    reads: int = 0  # peer reads started
    blocks: int = 0  # blocks read byte-exact from peers into G2
    bytes: int = 0
    checksum_failures: int = 0  # blocks whose bytes did not match the peer's checksum: misses
    refused: int = 0  # reads a peer refused (forbidden, busy, ...)
    failed: int = 0  # reads that failed (no reply in time, a transfer error: a stopped or dead peer)
    late: int = 0  # lookups that answered before their peer read was done (the budget ran out)
    reading_slots: int = 0  # own G2 slots reserved for reads in flight now
    quarantined_slots: int = 0  # own G2 slots of failed READs held back from reuse now (QUARANTINE_S)
    # Where a read's time goes, stage by stage (summed over reads; ``kvbm bench p2p`` reports them per load):
    pin_seconds: float = 0.0  # from asking to the peer's Pinned (a first contact's Connect included)
    prepare_seconds: float = 0.0  # reserving own G2 slots
    read_seconds: float = 0.0  # in NIXL READs
    verify_seconds: float = 0.0  # checksumming what was read, after the last READ ended (the rest overlaps it)
    commit_seconds: float = 0.0  # committing the good blocks to G2


class PeerReads:
    """Fills a lookup's bucket-only (or missing) blocks from a peer's G2 (see the module doc)."""

    def __init__(self, fc: FleetConfig, manager: BlockManager, peers: Callable[[], Sequence[PeerFollower]],
                 node_id: str) -> None:
        self.fc = fc
        self.manager = manager
        self._peers = peers
        self.node_id = node_id
        self.stats = ReadStats()
        # Told the blocks committed after a read, with the checksums they were verified against (peer_sums).
        self.verified: Callable[[list[tuple[BlockKey, int, int]]], None] | None = None
        self.per_peer: dict[str, dict[str, int]] = {}  # node (or endpoint) -> blocks, bytes, refused, failed
        self.links = Links(fc.peer_read_lease_ms / 1000, node_id)
        self._reading: dict[BlockKey, asyncio.Task[int]] = {}
        self._tasks: set[asyncio.Task[int]] = set()
        self._stalled: dict[str, int] = {}  # peer endpoint -> its reads still running past a lookup's budget
        self._late: set[asyncio.Task[int]] = set()
        self._owner: dict[asyncio.Task[int], str] = {}  # a read in flight -> its peer's endpoint
        self._cooldown: dict[str, float] = {}  # peer endpoint -> when it may be asked again after a failure
        self.fetcher = Fetcher()

    def start(self, ctx: zmq.asyncio.Context, agent: PeerAgent, token: str,
              curve: Callable[[PeerFollower], tuple[str, str, str] | None]) -> None:
        self.links.start(ctx, agent, token, curve)

    @property
    def agent(self) -> PeerAgent | None:
        return self.links.agent

    @agent.setter
    def agent(self, agent: PeerAgent | None) -> None:
        self.links.agent = agent

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
            if self.stats.quarantined_slots >= max(1, self.g2.num_slots // 4):
                return tiers  # failed READs hold a quarter of G2 back already: the bucket until they are released
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
            self._tasks.add(task)  # every read, for close (another read may take over some of its keys above)
            task.add_done_callback(self._tasks.discard)
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

    def forget_peer(self, endpoint: str) -> None:
        """A peer left the fleet: its link and cooldown go (a departed peer is never asked again)."""
        self.links.forget(endpoint)
        self._cooldown.pop(endpoint, None)

    async def _read(self, peer: PeerFollower, keys: list[BlockKey]) -> int:
        """Read ``keys`` from ``peer`` into G2; returns blocks committed. Never leaves a slot reserved."""
        self.stats.reads += 1
        t0 = time.monotonic()
        held: list[Link] = []  # the link this read uses, once it has one
        try:
            return await self._pin_and_copy(peer, keys, t0, held)
        finally:
            for link in held:
                self.links.release(link)

    async def _pin_and_copy(self, peer: PeerFollower, keys: list[BlockKey], t0: float, held: list[Link]) -> int:
        try:
            link = await self.links.acquire(peer)
            held.append(link)
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
            self.links.forget(peer.endpoint)  # a later read connects afresh (the peer may come back another process)
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
            if pinned.lease:  # not waited for: the lookup has its blocks (the pin expires on its own otherwise)
                self.links.unpin(link, pinned.lease, max(0.5, self.fc.peer_read_lease_ms / 1000))

    async def _copy(self, peer: PeerFollower, link: Link, keys: list[BlockKey], pinned: m.Pinned,
                    deadline: float) -> int:
        assert self.agent is not None and link.remote is not None
        by_size: dict[int, list[int]] = {}
        for i, n in enumerate(pinned.nbytes):
            by_size.setdefault(n, []).append(i)
        mine: dict[int, int] = {}  # index in keys -> own slot
        prepared: list[BlockKey] = []
        started: list[bool] = []  # appended to by the read's thread before its first READ is posted
        t0 = time.monotonic()
        try:
            for nbytes, idx in by_size.items():
                slots = await self.manager.prepare_store([keys[i] for i in idx], nbytes, TierName.G2)
                for i, s in zip(idx, slots, strict=True):
                    if s is not None:
                        mine[i] = s
                        prepared.append(keys[i])
            self.stats.reading_slots += len(prepared)
            self.stats.prepare_seconds += time.monotonic() - t0
            assert self.agent is not None and link.remote is not None
            good, read_s, verify_s = await asyncio.to_thread(
                self.fetcher.fetch, self.agent, link.remote_name, link.remote, self.g2, sorted(mine.items()), pinned,
                deadline, started)
            self.stats.read_seconds += read_s
            self.stats.verify_seconds += verify_s
        except BaseException as e:
            # A READ may still land in these slots (posted; or, cancelled, its thread runs on): held back a while.
            if started or isinstance(e, asyncio.CancelledError):
                self._quarantine(prepared)
            else:
                self.manager.complete_store(prepared, ok=False)
            self.stats.reading_slots -= len(prepared)
            if isinstance(e, (OSError, KvbmError)):
                self.stats.failed += 1
                self._count(peer, "failed")
                # Not asked again for a while (each failed READ holds slots back), and linked afresh after that.
                self._cooldown[peer.endpoint] = time.monotonic() + COOLDOWN_S
                if started:
                    self.links.forget(peer.endpoint)
                logj("p2p.read_failed", level=logging.WARNING, peer=peer.endpoint, why=str(e))
                return 0
            raise
        self.stats.reading_slots -= len(prepared)
        ok = [keys[i] for i in good]
        bad = [keys[i] for i in mine if i not in good]
        t3 = time.monotonic()
        self.manager.complete_store(bad, ok=False)
        done = self.manager.complete_store(ok, ok=True, cascade=False) if ok else 0
        if self.verified is not None and ok:  # this daemon's peers reading them get the sums with no hash
            self.verified([(keys[i], mine[i], pinned.checksums[i]) for i in good])
        self.stats.commit_seconds += time.monotonic() - t3
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

    def _quarantine(self, keys: list[BlockKey]) -> None:
        """Abort the stores of ``keys`` but keep their slots referenced for ``QUARANTINE_S`` (see there)."""
        leases = list(self.manager.detach_store(keys).values())
        self.stats.quarantined_slots += len(leases)

        def release() -> None:
            self.stats.quarantined_slots -= len(leases)
            self.manager.release(leases)

        asyncio.get_running_loop().call_later(QUARANTINE_S, release)

    def describe(self) -> dict[str, Any]:
        d = msgspec.structs.asdict(self.stats)
        d["peers"] = self.per_peer
        return d

    async def close(self) -> None:
        """Cancel the reads in flight and wait for their threads to leave NIXL (each READ has its pin's deadline),
        then close the links: the agent and G2 they READ into are closed after this, never under a READ."""
        tasks = set(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + self.fc.peer_read_lease_ms / 1000 + CLOSE_WAIT_S
        while self.fetcher.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.links.close()
        self.fetcher.shutdown()


def read_token(fc: FleetConfig) -> str:
    """``fleet.peer_read_token_file``'s token ("" without one). Blocking: call it in a thread."""
    return read_token_file(fc.peer_read_token_file, "fleet.peer_read_token_file")
