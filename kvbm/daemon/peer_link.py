"""One peer's peer-read socket as the asking side holds it (:mod:`kvbm.daemon.peer_reads`): a DEALER with CURVE
when the peer has keys, requests matched to replies by id, a late Pinned (the asker gave up waiting) handed back
at once, and an Unpin the asker does not wait for; and :class:`Links`, the asker's links by peer."""

from __future__ import annotations

import asyncio
import errno
import itertools
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvbm.daemon.logs import logj
from kvbm.errors import KvbmError
from kvbm.fleet import p2p as m
from kvbm.fleet.peers import PeerFollower


class PeerRefused(KvbmError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Link:
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
        self.users = 0  # reads using it now: a link dropped (failed, the peer gone) is closed by its last one
        self.dropped = False
        self.shut = False  # closed by Links (once)

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
                self.unpin(reply.lease)  # a pin answered after we gave up on it (a peer that was stopped)

    def unpin(self, lease: int, timeout_s: float = 5.0) -> asyncio.Task[None]:
        """Give a pin back without waiting for the answer (the peer drops it at its lease's end otherwise)."""
        task = asyncio.ensure_future(self._drop(lease, timeout_s))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)
        return task

    async def _drop(self, lease: int, timeout_s: float) -> None:
        try:
            await self.request(m.Unpin(lease=lease), timeout_s)
        except (OSError, KvbmError, zmq.ZMQError):
            pass  # the link closed under it (a failed or departed peer): the pin ends at its lease

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self.sock.close(0)


class Links:
    """The asking side's links, by peer (events endpoint): made on first use (Connect: NIXL agent metadata over the
    peer channel, never the bucket), dropped when a read on it fails or the peer leaves or restarts, and closed
    (its NIXL remote removed, in a thread) by the last read using it: never under a READ in flight."""

    def __init__(self, lease_s: float, node_id: str) -> None:
        self.lease_s = lease_s
        self.node_id = node_id
        self.agent: Any = None  # the PeerAgent, once started
        self.token = ""
        self.ctx: zmq.asyncio.Context | None = None
        self.curve: Callable[[PeerFollower], tuple[str, str, str] | None] = lambda _p: None
        self._links: dict[str, Link] = {}
        # Links per NIXL remote name: a peer process has one name, and a dropped link closing late must not remove
        # the remote a newer link to the same process loaded again (NIXL keeps one entry per name).
        self._remote_refs: dict[str, int] = {}
        self._remote_lock = asyncio.Lock()
        self._retired: set[Link] = set()  # dropped, still used (a read, an Unpin on its way)
        self.removals: set[asyncio.Task[None]] = set()

    def start(self, ctx: zmq.asyncio.Context, agent: Any, token: str,
              curve: Callable[[PeerFollower], tuple[str, str, str] | None]) -> None:
        self.ctx, self.agent, self.token, self.curve = ctx, agent, token, curve

    async def acquire(self, peer: PeerFollower) -> Link:
        """``peer``'s link, connected, counted as used until :meth:`release`."""
        hello = peer.hello
        assert hello is not None and self.ctx is not None and self.agent is not None
        link = self._links.get(peer.endpoint)
        if link is not None and (link.instance != hello.instance or link.endpoint != hello.endpoint):
            self.forget(peer.endpoint)  # the peer restarted: its agent and pins are gone
            link = None
        if link is None:
            link = self._links[peer.endpoint] = Link(self.ctx, hello.endpoint, hello.instance, self.curve(peer))
        link.users += 1
        try:
            async with link.lock:
                if link.remote is None:
                    meta = await asyncio.to_thread(self.agent.metadata)
                    got: m.Connected = await link.request(
                        m.Connect(node_id=self.node_id, agent=meta, token=self.token), self.lease_s)
                    async with self._remote_lock:  # never interleaved with a closed link's removal of it
                        link.remote_name = await asyncio.to_thread(self.agent.add_remote, got.agent)
                        self._remote_refs[link.remote_name] = self._remote_refs.get(link.remote_name, 0) + 1
                    link.remote = got
                    logj("p2p.linked", peer=hello.node_id, endpoint=hello.endpoint, agent=got.agent_name)
        except BaseException:
            self.release(link)
            raise
        return link

    def unpin(self, link: Link, lease: int, timeout_s: float) -> None:
        """``link.unpin``, the link kept open (counted as used) until the Unpin is sent and answered or given up:
        a link dropped meanwhile would otherwise lose it, and the peer hold the pin to its lease's end."""
        link.users += 1
        link.unpin(lease, timeout_s).add_done_callback(lambda _t: self.release(link))

    def release(self, link: Link) -> None:
        link.users -= 1
        if link.dropped and link.users <= 0:
            self._close(link)

    def forget(self, endpoint: str) -> None:
        """Drop ``endpoint``'s link: later reads connect afresh; closed once the reads still using it end."""
        link = self._links.pop(endpoint, None)
        if link is not None:
            link.dropped = True
            if link.users <= 0:
                self._close(link)
            else:
                self._retired.add(link)

    def _close(self, link: Link) -> None:
        if link.shut:
            return
        link.shut = True
        self._retired.discard(link)
        name, link.remote_name = link.remote_name, ""
        if name:
            self._remote_refs[name] = self._remote_refs.get(name, 1) - 1
            task = asyncio.ensure_future(self._remove(name))
            self.removals.add(task)
            task.add_done_callback(self.removals.discard)
        link.close()

    async def _remove(self, name: str) -> None:
        """Remove remote ``name`` unless a link still uses it (or loaded it again meanwhile)."""
        async with self._remote_lock:
            if self._remote_refs.get(name, 0) > 0 or self.agent is None:
                return
            self._remote_refs.pop(name, None)
            await asyncio.to_thread(self.agent.remove_remote, name)  # NIXL's endpoint teardown may block

    async def close(self) -> None:
        """Every link (the reads using them ended first: :meth:`PeerReads.close`)."""
        for ep in list(self._links):
            self.forget(ep)
        for link in list(self._retired):  # only Unpins on their way use them now: the peers' leases end them
            self._close(link)
        await asyncio.gather(*self.removals, return_exceptions=True)
