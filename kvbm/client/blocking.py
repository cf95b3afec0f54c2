"""The blocking worker client of the kvbm daemon: :class:`WorkerClient` (``kvbm.client.aio`` is the asyncio one).

Block bytes never travel over the socket: :meth:`WorkerClient.register` maps the daemon's G2 slot pool (shared
memory), ``store`` copies into the slots the daemon reserved, ``load`` copies out of the slots it
onboarded into. Requests carry ids; a reply that does not arrive within ``timeout_s`` raises
:class:`DaemonUnavailable` (and the socket is recreated, so a late reply cannot be mistaken for the next).
``WorkerClient(fail_fast=True)`` (the vLLM connector's) does not wait that long for a daemon that is gone: it
watches its socket (ZeroMQ monitor events, and ZMTP heartbeats for a peer that vanished without closing) and
raises :class:`DaemonUnavailable` as soon as the connection drops, is refused or fails its handshake.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client.core import Buffer, R, _Core
from kvbm.client.errors import DaemonError, DaemonUnavailable
from kvbm.client.lease import onboarded, reserving, session_budget
from kvbm.client.wire import Wire

__all__ = ["WorkerClient"]


class WorkerClient(_Core):
    """Blocking client (one thread at a time)."""

    store_batch = 1024  # blocks per PrepareStore/CommitStore pair of a larger store (which is then pipelined)
    store_window = 4  # CommitStores of one store in flight at most

    def __init__(self, endpoint: str, *, ctx: zmq.Context[Any] | None = None, fail_fast: bool = False,
                 **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self._ctx = ctx or zmq.Context.instance()
        self.fail_fast = fail_fast
        self._wire = Wire(self.endpoint, self._ctx, self._setup, fail_fast)  # the socket and the requests in flight
        self._sent = self._wire.sent  # rids sent and not yet awaited (the wire's set, read here)

    def _reset(self) -> None:
        self._wire.reset()

    def abandon(self, unregister: bool = True) -> None:
        """Drop this session without waiting on the daemon: Unregister is sent (so a live daemon releases this
        worker's pins and slots) but not awaited, G2 is unmapped and the socket closed. Without ``unregister`` the
        daemon keeps the session's pins until its lease runs out (another process may still read them)."""
        token = self.token if unregister else ""
        self._reset()
        if token:
            with contextlib.suppress(zmq.ZMQError):
                sock = self._ctx.socket(zmq.DEALER)
                self._setup(sock)
                sock.send(self._prep(p.Unregister()), flags=zmq.NOBLOCK)
                sock.close(200)  # delivered in the background if the daemon is there, dropped soon if not
        self._forget()

    def lost(self) -> bool:
        """Whether the daemon's connection dropped since it was last used (fail-fast clients; no round trip)."""
        return self._wire.lost()

    def request(self, msg: Any, expect: type[R], timeout_s: float | None = None) -> R:
        """Send ``msg`` and wait for the reply with its rid (registering again if the daemon forgot us)."""
        reply = self._roundtrip(msg, timeout_s)
        if self._reregister(msg, reply):
            self._attach(self._roundtrip(self._reg_msg, None))
            reply = self._roundtrip(msg, timeout_s)
        return self._check(reply, expect)

    def _roundtrip(self, msg: Any, timeout_s: float | None) -> Any:
        self._send(msg)
        return self._await(msg, timeout_s)

    def begin(self, msg: Any) -> Any:
        """Send ``msg`` without waiting for its reply (pipelining; :meth:`finish` reads the reply)."""
        self._send(msg)
        return msg

    def finish(self, msg: Any, expect: type[R]) -> R:
        """The reply to ``msg`` sent by :meth:`begin`, checked as :meth:`request` does."""
        reply = self._await(msg)
        if self._reregister(msg, reply):
            return self.request(msg, expect)
        return self._check(reply, expect)

    def _send(self, msg: Any) -> None:
        """Send ``msg`` (its rid set) without waiting: several requests may be in flight, see :meth:`_await`."""
        buf = self._prep(msg)  # sets msg.rid
        self._wire.send(msg.rid, buf)

    def _await(self, msg: Any, timeout_s: float | None = None) -> Any:
        """The reply to ``msg`` (sent by :meth:`_send`); replies to other requests in flight are kept."""
        return self._wire.wait(msg.rid, self.timeout_s if timeout_s is None else timeout_s, self.max_message_bytes,
                               self.timeout_s)

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

    def store(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer], *, durable: bool = False,
              partial: bool = False, covers: Sequence[Sequence[BlockKey | bytes]] | None = None) -> p.Ack:
        """prepare -> copy into G2 slots -> commit. Raises Overloaded when the daemon sheds it. ``partial``: the
        blocks are partial blocks; ``covers``: per key, the partial blocks it supersedes (see
        :class:`kvbm.protocol.CommitStore`).

        More than :attr:`store_batch` blocks (or than G2 holds: then in batches that all fit in half of it, so a
        store larger than G2 streams through it) go in batches of that many, pipelined: the next batch's
        PrepareStore is sent before this batch is copied, and up to :attr:`store_window` CommitStores are in
        flight, so the daemon reserves and commits while this process copies.
        """
        ns, hashes, n = self._store_msgs(keys, bufs)
        cov = self._covers(covers, ns, len(hashes))
        if not hashes:
            return p.Ack(stored=0)
        # In flight at once: the batch prepared ahead, the one being copied and store_window commits.
        step = self._store_step(len(hashes), self.store_batch, self.store_window + 2)
        if len(hashes) > step:
            return self._store_pipelined(ns, hashes, bufs, n, durable, step, partial, cov)
        with reserving(self, hashes, n, durable=durable, namespace=ns, partial=partial, covers=cov) as res:
            self._copy_in(res.slots, bufs, n)
        assert res.ack is not None
        return res.ack

    def _store_pipelined(self, ns: str, hashes: list[bytes], bufs: Sequence[Buffer], n: int, durable: bool,
                         step: int, partial: bool, covers: list[list[bytes]]) -> p.Ack:
        spans = [(i, min(i + step, len(hashes))) for i in range(0, len(hashes), step)]

        def prepare(a: int, b: int) -> p.PrepareStore:
            msg = p.PrepareStore(namespace=ns, hashes=hashes[a:b], nbytes=n)
            self._send(msg)
            return msg

        ahead: p.PrepareStore | None = prepare(*spans[0])
        commits: list[p.CommitStore] = []
        acks: list[p.Ack] = []
        try:
            for j, (a, b) in enumerate(spans):
                assert ahead is not None
                msg, ahead = ahead, None
                reply = self._await(msg)
                if self._reregister(msg, reply):
                    acks += [self._check(self._await(c), p.Ack) for c in commits]  # the daemon forgot us: settle
                    commits = []
                    reply = self.request(p.PrepareStore(namespace=ns, hashes=hashes[a:b], nbytes=n), p.Slots)
                if j and isinstance(reply, p.Error) and reply.code == p.E_FULL:
                    reply = self._prepare_when_room(ns, hashes[a:b], n, reply)
                slots = self._check(reply, p.Slots).slots
                if j + 1 < len(spans):
                    ahead = prepare(*spans[j + 1])
                try:
                    self._copy_in(slots, bufs[a:b], n)
                except BaseException:
                    self.request(p.CommitStore(namespace=ns, hashes=hashes[a:b], ok=False), p.Ack)
                    raise
                if len(commits) >= self.store_window:
                    acks.append(self._check(self._await(commits.pop(0)), p.Ack))
                commit = p.CommitStore(namespace=ns, hashes=hashes[a:b], durable=durable, partial=partial,
                                       covers=covers[a:b])
                self._send(commit)
                commits.append(commit)
            acks += [self._check(self._await(c), p.Ack) for c in commits]
            commits = []
        finally:
            self._settle(ahead, commits)
        return p.Ack(stored=sum(a.stored for a in acks), durable=sum(a.durable for a in acks))

    def _prepare_when_room(self, ns: str, hashes: list[bytes], n: int, reply: Any) -> Any:
        """Ask again for a batch refused ``full`` after earlier batches of the same store were committed (their
        slots free once written down), with backoff up to ``timeout_s``; the last reply either way."""
        for delay in self._full_waits(time.monotonic() + self.timeout_s):
            time.sleep(delay)
            msg = p.PrepareStore(namespace=ns, hashes=hashes, nbytes=n)
            self._send(msg)
            reply = self._await(msg)
            if not (isinstance(reply, p.Error) and reply.code == p.E_FULL):
                break
        return reply

    def _settle(self, ahead: p.PrepareStore | None, commits: list[p.CommitStore]) -> None:
        """After a pipelined store failed: abort the batch prepared ahead and wait out the commits in flight."""
        # Only requests still in flight on this socket (a timeout reset it: their replies are gone). Each
        # wait apart, so a failed abort does not leave the commits' replies parked.
        with contextlib.suppress(DaemonUnavailable, DaemonError):
            if ahead is not None and ahead.rid in self._sent and isinstance(self._await(ahead), p.Slots):
                self.request(p.CommitStore(namespace=ahead.namespace, hashes=ahead.hashes, ok=False), p.Ack)
        for c in commits:
            with contextlib.suppress(DaemonUnavailable, DaemonError):
                if c.rid in self._sent:
                    self._await(c)

    def load(self, keys: Sequence[BlockKey | bytes], outs: Sequence[Buffer]) -> int:
        """onboard -> copy the leading held run out of G2 -> release; returns blocks loaded (at most this
        session's slot budget: the daemon would pin no more)."""
        ns, hashes = self._ns(keys)
        if self.registered is not None:
            hashes = hashes[: session_budget(self.registered)]
        with onboarded(self, hashes, ns) as got:
            self._copy_out(got.reply, outs)
        return got.count

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
