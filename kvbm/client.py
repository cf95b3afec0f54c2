"""Worker-side clients of the kvbm daemon: :class:`WorkerClient` (blocking) and :class:`AsyncWorkerClient`.

Block bytes never travel over the socket: :meth:`register` maps the daemon's G2 slot pool (shared
memory), ``store`` copies into the slots the daemon reserved, ``load`` copies out of the slots it
onboarded into. The mapping follows the pool's generation: when a re-registration (after a daemon
restart, kill -9 or clean) reports a new one, the client maps the new pool, even under the same
``shm_name``, and its slot requests carry the generation so the daemon refuses any that do not match.
Requests carry ids; a reply that does not arrive within ``timeout_s`` raises
:class:`DaemonUnavailable` (and the socket is recreated, so a late reply cannot be mistaken for the next).

Credentials: ``curve_server_key`` (the daemon's public key) turns CURVE on, with ``curve_keypair`` the
client's own keys (an allow-listed daemon needs them; without them a throwaway pair is made);
``admin_token`` (the daemon's admin token file, see :mod:`kvbm.security`) makes the registration an admin
one. :func:`client_options` reads all three from a config the way the CLI does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import zmq
import zmq.asyncio

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError
from kvbm.layout import KVLayout
from kvbm.tiers.host import HostTier

R = TypeVar("R")
Buffer = Any  # bytes-like, numpy array or torch tensor (CPU or CUDA)


def client_options(dc: Any, *, admin: bool = False) -> dict[str, Any]:
    """Client keyword arguments for a :class:`kvbm.config.DaemonConfig`: CURVE keys from its files and,
    with ``admin``, the admin token when this user can read its file ("" otherwise: no admin session)."""
    from kvbm.security import admin_token_path, client_curve, read_admin_token

    server, keypair = client_curve(dc)
    out: dict[str, Any] = {"curve_server_key": server, "curve_keypair": keypair}
    if admin:
        out["admin_token"] = read_admin_token(admin_token_path(dc))
    return out


class DaemonUnavailable(KvbmError):
    """The daemon did not answer in time (not running, overloaded, or unreachable)."""


class DaemonError(KvbmError):
    """The daemon answered with an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Overloaded(DaemonError):
    """The daemon shed an offload; retry later (``retry_after_ms``)."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__("shed", f"daemon overloaded, retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


def _flat_u8(buf: Buffer) -> torch.Tensor:
    """A flat uint8 tensor view of ``buf`` (no copy for tensors, numpy arrays and writable buffers)."""
    if isinstance(buf, torch.Tensor):
        return buf.detach().contiguous().view(torch.uint8).reshape(-1)
    arr = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else buf
    arr = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    if not arr.flags.writeable:
        arr = arr.copy()  # a source only; torch cannot wrap read-only memory
    return torch.from_numpy(arr)


def _nbytes(buf: Buffer) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes if not isinstance(buf, np.ndarray) else buf.nbytes


# Requests that may be sent again after re-registering (a CommitStore or Release would refer to slots or
# pins the daemon already dropped with the old registration).
_RESENDABLE = (p.Ping, p.Lookup, p.Stats, p.PrepareStore, p.Onboard, p.Barrier, p.Evict)


class _Core:
    """Message building and the G2 mapping shared by both clients."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
        curve_server_key: str = "",
        curve_keypair: tuple[bytes, bytes] | None = None,
        admin_token: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.admin_token = admin_token
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.curve_server_key = curve_server_key
        self.curve_keypair = curve_keypair
        self.token = ""
        self.namespace = ""
        self.registered: p.Registered | None = None
        self.g2: HostTier | None = None
        self.generation = ""  # of the G2 pool mapped in self.g2
        self._reg_msg: p.Register | None = None
        self._rids = itertools.count(1)

    def _setup(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_server_key:
            pub, sec = self.curve_keypair or zmq.curve_keypair()
            sock.curve_serverkey = self.curve_server_key.encode()
            sock.curve_publickey = pub
            sock.curve_secretkey = sec
        sock.connect(self.endpoint)

    def _prep(self, msg: Any) -> bytes:
        msg.rid = next(self._rids)
        if not isinstance(msg, p.Register):
            msg.token = self.token
        if isinstance(msg, p._SlotReq):
            msg.generation = self.generation
        return p.encode(msg, self.max_message_bytes)

    def _reregister(self, msg: Any, reply: Any) -> bool:
        """Whether to register again and resend: the daemon forgot us (restart, lease) and ``msg`` is safe."""
        return (isinstance(reply, p.Error) and reply.code in (p.E_UNREGISTERED, p.E_STALE)
                and self._reg_msg is not None and isinstance(msg, _RESENDABLE))

    @staticmethod
    def _check(reply: Any, expect: type[R]) -> R:
        if isinstance(reply, p.Shed):
            raise Overloaded(reply.retry_after_ms)
        if isinstance(reply, p.Error):
            raise DaemonError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise DaemonError(p.E_BAD_REQUEST, f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    def _ns(self, keys: Sequence[BlockKey | bytes]) -> tuple[str, list[bytes]]:
        """One namespace and the hashes; plain hashes use this worker's namespace."""
        if not keys:
            return self.namespace, []
        if isinstance(keys[0], BlockKey):
            ns = keys[0].namespace
            if any(k.namespace != ns for k in keys):  # type: ignore[union-attr]
                raise ValueError("all keys of one request must share a namespace")
            return ns, [k.hash for k in keys]  # type: ignore[union-attr]
        return self.namespace, list(keys)  # type: ignore[arg-type]

    def _register_msg(self, layout: KVLayout, worker_id: str, engine_id: str, tp_rank: int | None,
                      tp_size: int | None, g1_capacity_blocks: int) -> p.Register:
        return p.Register(
            worker_id=worker_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}",
            engine_id=engine_id or "engine", layout=layout,
            tp_rank=layout.tp_rank if tp_rank is None else tp_rank,
            tp_size=layout.tp_size if tp_size is None else tp_size,
            g1_capacity_blocks=g1_capacity_blocks, admin_token=self.admin_token,
        )

    def _attach(self, reg: p.Registered) -> None:
        if isinstance(reg, p.Error):
            raise DaemonError(reg.code, reg.message)
        self.token, self.namespace, self.registered = reg.token, reg.namespace, reg
        # A new generation is a new pool even under the same name: the old mapping is an orphan.
        if self.g2 is None or self.g2.shm_name != reg.shm_name or self.generation != reg.generation:
            self._detach()
            self.g2 = HostTier.attach(reg.shm_name, reg.capacity_bytes, reg.slot_bytes)
            self.generation = reg.generation

    def _forget(self) -> None:
        """Drop the registration, the G2 mapping and the socket (after Unregister, or when it failed)."""
        self.token = ""
        self._reg_msg = None
        self._detach()
        self._reset()

    def _detach(self) -> None:
        if self.g2 is not None:
            self.g2.release()
            self.g2 = None
            self.generation = ""

    def _store_msgs(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer]) -> tuple[str, list[bytes], int]:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        ns, hashes = self._ns(keys)
        sizes = {_nbytes(b) for b in bufs}
        if len(sizes) > 1:
            raise ValueError(f"buffers of one store must be equal-sized, got {sorted(sizes)}")
        return ns, hashes, sizes.pop() if sizes else 0

    def _copy_in(self, slots: Sequence[int | None], bufs: Sequence[Buffer], n: int) -> None:
        assert self.g2 is not None, "register first"
        for slot, buf in zip(slots, bufs, strict=True):
            if slot is not None:
                self.g2.slot_tensor(slot, n).copy_(_flat_u8(buf))

    def _copy_out(self, rep: p.Onboarded, outs: Sequence[Buffer]) -> None:
        assert self.g2 is not None, "register first"
        for slot, nb, out in zip(rep.slots, rep.nbytes, outs, strict=False):
            dst = _flat_u8(out)
            if dst.numel() < nb:
                raise ValueError(f"output buffer of {dst.numel()} bytes < block of {nb}")
            dst[:nb].copy_(self.g2.slot_tensor(slot, nb))


class WorkerClient(_Core):
    """Blocking client (one thread at a time)."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context[Any] | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._setup(self._sock)
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, msg: Any, expect: type[R], timeout_s: float | None = None) -> R:
        """Send ``msg`` and wait for the reply with its rid (registering again if the daemon forgot us)."""
        reply = self._roundtrip(msg, timeout_s)
        if self._reregister(msg, reply):
            self._attach(self._roundtrip(self._reg_msg, None))
            reply = self._roundtrip(msg, timeout_s)
        return self._check(reply, expect)

    def _roundtrip(self, msg: Any, timeout_s: float | None) -> Any:
        buf = self._prep(msg)
        sock = self._socket()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            sock.send(buf, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._reset()
            raise DaemonUnavailable(f"cannot send to {self.endpoint}") from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                self._reset()
                raise DaemonUnavailable(f"no reply from {self.endpoint} within {self.timeout_s:g}s")
            frames = sock.recv_multipart()
            try:
                reply = p.decode_reply(frames[-1], self.max_message_bytes)
            except p.ProtocolError:
                continue
            if reply.rid == msg.rid:
                return reply

    def register(self, layout: KVLayout, *, worker_id: str = "", engine_id: str = "", tp_rank: int | None = None,
                 tp_size: int | None = None, g1_capacity_blocks: int = 0) -> p.Registered:
        """Register and map the daemon's G2 pool."""
        msg = self._register_msg(layout, worker_id, engine_id, tp_rank, tp_size, g1_capacity_blocks)
        reg = self.request(msg, p.Registered)
        self._reg_msg = msg
        self._attach(reg)
        return reg

    def ping(self) -> None:
        self.request(p.Ping(), p.Pong)

    def lookup(self, keys: Sequence[BlockKey | bytes]) -> p.LookupReply:
        ns, hashes = self._ns(keys)
        return self.request(p.Lookup(namespace=ns, hashes=hashes), p.LookupReply)

    def store(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer], *, durable: bool = False) -> p.Ack:
        """prepare -> copy into G2 slots -> commit. Raises Overloaded when the daemon sheds it."""
        ns, hashes, n = self._store_msgs(keys, bufs)
        if not hashes:
            return p.Ack(stored=0)
        slots = self.request(p.PrepareStore(namespace=ns, hashes=hashes, nbytes=n), p.Slots).slots
        try:
            self._copy_in(slots, bufs, n)
        except BaseException:
            self.request(p.CommitStore(namespace=ns, hashes=hashes, ok=False), p.Ack)
            raise
        return self.request(p.CommitStore(namespace=ns, hashes=hashes, durable=durable), p.Ack)

    def load(self, keys: Sequence[BlockKey | bytes], outs: Sequence[Buffer]) -> int:
        """onboard -> copy the leading held run out of G2 -> release; returns blocks loaded."""
        ns, hashes = self._ns(keys)
        rep = self.request(p.Onboard(namespace=ns, hashes=hashes), p.Onboarded)
        try:
            self._copy_out(rep, outs)
        finally:
            if rep.count:
                self.request(p.Release(namespace=ns, hashes=hashes[: rep.count]), p.Released)
        return rep.count

    def stats(self, *, resident: bool = False) -> dict[str, Any]:
        return self.request(p.Stats(resident=resident), p.StatsReply).stats

    def barrier(self, engine_id: str, step: int | str, rank: int, world_size: int = 0,
                timeout_s: float = 0.0) -> p.BarrierReply:
        wait = (timeout_s or self.timeout_s) + self.timeout_s
        return self.request(p.Barrier(engine_id=engine_id, step=step, rank=rank, world_size=world_size,
                                      timeout_s=timeout_s), p.BarrierReply, wait)

    def evict(self, keys: Sequence[BlockKey | bytes] | None = None, *, namespace: str = "",
              tiers: list[str] | None = None) -> p.Evicted:
        if keys is None:
            return self.request(p.Evict(namespace=namespace or self.namespace, tiers=tiers), p.Evicted)
        ns, hashes = self._ns(keys)
        return self.request(p.Evict(namespace=ns, hashes=hashes, tiers=tiers), p.Evicted)

    def close(self) -> None:
        """Unregister (releasing this worker's pins) and unmap G2."""
        try:
            if self.token:
                self.request(p.Unregister(), p.Released, timeout_s=min(self.timeout_s, 2.0))
        except (DaemonUnavailable, DaemonError):
            pass
        finally:
            self._forget()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncWorkerClient(_Core):
    """asyncio client; many requests may be in flight at once (replies are matched by rid)."""

    def __init__(self, endpoint: str, *, ctx: zmq.asyncio.Context | None = None, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._heartbeat: asyncio.Task[None] | None = None

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

    async def request(self, msg: Any, expect: type[R], timeout_s: float | None = None) -> R:
        """Send ``msg`` and await the reply with its rid (registering again if the daemon forgot us)."""
        reply = await self._roundtrip(msg, timeout_s)
        if self._reregister(msg, reply):
            self._attach(await self._roundtrip(self._reg_msg, None))
            reply = await self._roundtrip(msg, timeout_s)
        return self._check(reply, expect)

    async def _roundtrip(self, msg: Any, timeout_s: float | None) -> Any:
        buf = self._prep(msg)
        sock = self._socket()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            await sock.send(buf)
            reply = await asyncio.wait_for(fut, self.timeout_s if timeout_s is None else timeout_s)
        except TimeoutError:
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

    def start_heartbeat(self, interval_s: float) -> None:
        """Ping every ``interval_s`` so the daemon keeps this worker's lease (and pins) alive."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.ping()
                except (DaemonUnavailable, DaemonError):
                    pass

        if self._heartbeat is None:
            self._heartbeat = asyncio.ensure_future(beat())

    async def ping(self) -> None:
        await self.request(p.Ping(), p.Pong)

    async def lookup(self, keys: Sequence[BlockKey | bytes]) -> p.LookupReply:
        ns, hashes = self._ns(keys)
        return await self.request(p.Lookup(namespace=ns, hashes=hashes), p.LookupReply)

    async def store(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer], *,
                    durable: bool = False) -> p.Ack:
        ns, hashes, n = self._store_msgs(keys, bufs)
        if not hashes:
            return p.Ack(stored=0)
        slots = (await self.request(p.PrepareStore(namespace=ns, hashes=hashes, nbytes=n), p.Slots)).slots
        try:
            await asyncio.to_thread(self._copy_in, slots, bufs, n)
        except BaseException:
            await self.request(p.CommitStore(namespace=ns, hashes=hashes, ok=False), p.Ack)
            raise
        return await self.request(p.CommitStore(namespace=ns, hashes=hashes, durable=durable), p.Ack)

    async def load(self, keys: Sequence[BlockKey | bytes], outs: Sequence[Buffer]) -> int:
        ns, hashes = self._ns(keys)
        rep = await self.request(p.Onboard(namespace=ns, hashes=hashes), p.Onboarded)
        try:
            await asyncio.to_thread(self._copy_out, rep, outs)
        finally:
            if rep.count:
                await self.request(p.Release(namespace=ns, hashes=hashes[: rep.count]), p.Released)
        return rep.count

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
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
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
