"""One peer's peer-read socket as the asking side holds it (:mod:`kvbm.daemon.peer_reads`): a DEALER with CURVE
when the peer has keys, requests matched to replies by id, a late Pinned (the asker gave up waiting) handed back
at once, and an Unpin the asker does not wait for."""

from __future__ import annotations

import asyncio
import errno
import itertools
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvbm.errors import KvbmError
from kvbm.fleet import p2p as m


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

    def unpin(self, lease: int, timeout_s: float = 5.0) -> None:
        """Give a pin back without waiting for the answer (the peer drops it at its lease's end otherwise)."""
        task = asyncio.ensure_future(self._drop(lease, timeout_s))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

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
