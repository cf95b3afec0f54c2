"""The asyncio daemon client (re-exported by :mod:`kvbm.client`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client.core import Buffer, R, _Core
from kvbm.client.errors import DaemonError, DaemonUnavailable
from kvbm.client.lease import SlotGate, aonboarded, areserving


async def _in_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` in a thread. If the caller is cancelled meanwhile, the thread is waited out before the
    cancellation goes on: it copies into or out of G2 slots, which the caller gives back right after (an
    abort or a Release), and another worker may be handed them at once."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([fut])
        raise


class AsyncWorkerClient(_Core):
    """asyncio client; many requests may be in flight at once (replies are matched by rid)."""

    def __init__(self, endpoint: str, *, ctx: zmq.asyncio.Context | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._registering = asyncio.Lock()  # one re-registration at a time (batches of a store run at once)
        self._slots = SlotGate()  # this session's slots, shared by the stores and loads in flight

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._setup(self._sock)
            self._reader = asyncio.ensure_future(self._read(self._sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                reply = p.decode_reply(frames[-1], self.max_message_bytes)
            except p.ProtocolError:
                continue
            fut = self._pending.pop(reply.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _reset(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DaemonUnavailable(f"connection to {self.endpoint} reset"))
        self._pending.clear()

    def _attach(self, reg: p.Registered) -> None:
        super()._attach(reg)  # raises on an Error reply
        self._slots.resize(reg)

    async def request(self, msg: Any, expect: type[R], timeout_s: float | None = None,
                      sent: Callable[[], Awaitable[None]] | None = None) -> R:
        """Send ``msg`` and await the reply with its rid (registering again if the daemon forgot us); ``sent`` is
        awaited once ``msg`` is on the wire (the daemon reads this session's requests in order)."""
        reply = await self._roundtrip(msg, timeout_s, sent)
        if self._reregister(msg, reply):
            async with self._registering:
                if msg.token == self.token:  # nobody registered again meanwhile
                    self._attach(await self._roundtrip(self._reg_msg, None))
            reply = await self._roundtrip(msg, timeout_s)
        return self._check(reply, expect)

    async def _roundtrip(self, msg: Any, timeout_s: float | None,
                         sent: Callable[[], Awaitable[None]] | None = None) -> Any:
        buf = self._prep(msg)
        sock = self._socket()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            await sock.send(buf)
            if sent is not None:
                await sent()
            reply = await asyncio.wait_for(fut, self.timeout_s if timeout_s is None else timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes on Python 3.10
            self._reset()
            raise DaemonUnavailable(f"no reply from {self.endpoint} within {self.timeout_s:g}s") from None
        finally:
            self._pending.pop(msg.rid, None)
        return reply

    async def register(self, layout: KVLayout, *, worker_id: str = "", engine_id: str = "",
                       tp_rank: int | None = None, tp_size: int | None = None,
                       g1_capacity_blocks: int = 0) -> p.Registered:
        msg = self._register_msg(layout, worker_id, engine_id, tp_rank, tp_size, g1_capacity_blocks)
        reg = await self.request(msg, p.Registered)
        self._reg_msg = msg
        self._attach(reg)
        return reg

    async def ping(self) -> None:
        await self.request(p.Ping(), p.Pong)

    async def lookup(self, keys: Sequence[BlockKey | bytes]) -> p.LookupReply:
        ns, hashes = self._ns(keys)
        return await self.request(p.Lookup(namespace=ns, hashes=hashes), p.LookupReply)

    store_batch = 1024  # blocks per PrepareStore/CommitStore when a store is larger
    store_window = 4  # batches of one store in flight at once (each prepares, copies and commits by itself)

    async def store(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer], *, durable: bool = False,
                    partial: bool = False, covers: Sequence[Sequence[BlockKey | bytes]] | None = None) -> p.Ack:
        """prepare -> copy into G2 slots -> commit; more than :attr:`store_batch` blocks go in batches of that
        many, :attr:`store_window` at a time. A batch that fails raises (after the others in flight ended);
        the batches committed before it stay. ``partial``, ``covers``: as :meth:`WorkerClient.store`'s."""
        ns, hashes, n = self._store_msgs(keys, bufs)
        cov = self._covers(covers, ns, len(hashes))
        if not hashes:
            return p.Ack(stored=0)
        step = self._store_step(len(hashes), self.store_batch, self.store_window)  # a store beyond G2 streams
        spans = [(i, min(i + step, len(hashes))) for i in range(0, len(hashes), step)]
        acks: list[p.Ack] = []
        for w in range(0, len(spans), self.store_window):
            # After the first window, a batch refused `full` waits for the committed ones to be written down.
            got = await asyncio.gather(*(self._store_batch(ns, hashes[a:b], bufs[a:b], n, durable, w > 0,
                                                           partial, cov[a:b])
                                         for a, b in spans[w : w + self.store_window]), return_exceptions=True)
            for r in got:
                if isinstance(r, BaseException):
                    raise r
            acks += got  # type: ignore[arg-type]
        return p.Ack(stored=sum(a.stored for a in acks), durable=sum(a.durable for a in acks))

    async def _store_batch(self, ns: str, hashes: list[bytes], bufs: Sequence[Buffer], n: int, durable: bool,
                           wait_for_room: bool = False, partial: bool = False,
                           covers: list[list[bytes]] | None = None) -> p.Ack:
        """One batch: reserve, copy, commit. With ``wait_for_room`` a PrepareStore refused ``full`` is asked
        again with backoff up to ``timeout_s`` (the store's committed batches free their slots once written)."""
        waits = self._full_waits(time.monotonic() + self.timeout_s) if wait_for_room else iter(())
        while True:
            reserved = False
            try:
                # The slots come back as the CommitStore goes out: the daemon frees them on reading it, before
                # any durable write (which may wait on S3 for seconds).
                async with self._slots.holding(len(hashes), self.timeout_s) as held, \
                        areserving(self, hashes, n, durable=durable, namespace=ns, sent=held.give_back,
                                   partial=partial, covers=covers) as res:
                    reserved = True
                    token = self.token  # the session these slots were reserved in
                    await _in_thread(self._copy_in, res.slots, bufs, n)
                    if self.token != token:  # another batch registered again: the daemon dropped the session
                        raise DaemonError(p.E_UNREGISTERED, "the daemon forgot this worker while the batch was "
                                                            "copied; the batch was not stored")
            except DaemonError as e:
                delay = None if reserved or e.code != p.E_FULL else next(waits, None)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            assert res.ack is not None
            return res.ack

    async def load(self, keys: Sequence[BlockKey | bytes], outs: Sequence[Buffer]) -> int:
        """Onboard -> copy out -> Release; the leading blocks loaded (at most this session's slot budget)."""
        ns, hashes = self._ns(keys)
        async with self._slots.taking(len(hashes), self.timeout_s) as n, aonboarded(self, hashes[:n], ns) as got:
            await _in_thread(self._copy_out, got.reply, outs)
        return got.count

    async def stats(self, *, resident: bool = False) -> dict[str, Any]:
        return (await self.request(p.Stats(resident=resident), p.StatsReply)).stats

    async def barrier(self, engine_id: str, step: int | str, rank: int, world_size: int = 0,
                      timeout_s: float = 0.0) -> p.BarrierReply:
        wait = (timeout_s or self.timeout_s) + self.timeout_s
        return await self.request(p.Barrier(engine_id=engine_id, step=step, rank=rank, world_size=world_size,
                                            timeout_s=timeout_s), p.BarrierReply, wait)

    async def evict(self, keys: Sequence[BlockKey | bytes] | None = None, *, namespace: str = "",
                    tiers: list[str] | None = None) -> p.Evicted:
        if keys is None:
            return await self.request(p.Evict(namespace=namespace or self.namespace, tiers=tiers), p.Evicted)
        ns, hashes = self._ns(keys)
        return await self.request(p.Evict(namespace=ns, hashes=hashes, tiers=tiers), p.Evicted)

    async def close(self) -> None:
        try:
            if self.token:
                await self.request(p.Unregister(), p.Released, timeout_s=min(self.timeout_s, 2.0))
        except (DaemonUnavailable, DaemonError):
            pass
        finally:
            self._forget()

    async def __aenter__(self) -> AsyncWorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
