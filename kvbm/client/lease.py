"""Slot leases, the worker's side: G2 slots reserved for a store, or pinned by a load, each given back once.

A store is PrepareStore -> copy into the reserved slots -> CommitStore; a load is Onboard -> copy out of the
pinned slots -> Release. :func:`reserving` and :class:`Onboarding` own those sequences, so a caller only
copies: whatever happens in its body, the daemon is told (a failed copy commits ``ok=False``, which frees the
slots; a load's pins are released). The daemon states how many slots one session may hold at once in
``Registered``; :func:`pin_window` reads it. :class:`PendingLookup` pipelines lookups the same way, and
:func:`is_load` tells the daemon saying it is loaded from a session failing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import torch

from kvbm import protocol as p
from kvbm.client.errors import DaemonError

# Answers that mean the daemon is loaded (no free slot or over a budget, shedding offloads, a lower tier out
# for now, too many requests in flight): this transfer is skipped or recomputed, the session stays up.
LOAD_CODES = frozenset({p.E_FULL, "shed", p.E_UNAVAILABLE, p.E_BUSY})
BAD_REQUEST = p.E_BAD_REQUEST  # the daemon refused what was asked (a layout it cannot store): not an outage


def is_load(e: BaseException) -> bool:
    """Whether ``e`` is the daemon saying it is loaded, not the session failing."""
    return isinstance(e, DaemonError) and e.code in LOAD_CODES


def pin_window(registered: p.Registered | None) -> int:
    """How many G2 slots this session may hold pinned or reserved at once: the daemon's per-session budget, and
    never more than half the pool (the other half takes the blocks being written down or brought up)."""
    if registered is None:
        return 1
    half = max(1, registered.num_slots // 2)
    return min(session_budget(registered), half)


def session_budget(registered: p.Registered) -> int:
    """The slots the daemon lets this session hold at once (``session_slots``; 0, not stated: the whole pool)."""
    return max(1, registered.session_slots or registered.num_slots)


class SlotGate:
    """The asyncio client's own count of the G2 slots its session holds (pinned + prepared + reserved, as the
    daemon counts them): a store batch or a load takes its slots here before it asks, so the operations of one
    session in flight together wait for each other's commits and releases instead of being refused ``full`` by
    the session budget. The daemon still decides: past ``timeout_s`` the request goes out and it answers."""

    def __init__(self) -> None:
        self.cap = 0  # 0: not registered yet, nothing is counted
        self.held = 0
        self._cond = asyncio.Condition()

    def resize(self, registered: p.Registered) -> None:
        self.cap = session_budget(registered)

    @asynccontextmanager
    async def taking(self, n: int, timeout_s: float) -> AsyncIterator[int]:
        """Hold ``min(n, cap)`` slots for the body (yielded: the most blocks the body may ask for)."""
        async with self.holding(n, timeout_s) as held:
            yield held.n

    @asynccontextmanager
    async def holding(self, n: int, timeout_s: float) -> AsyncIterator[Held]:
        """:meth:`taking`, yielding a :class:`Held` the body may give back before it ends."""
        if not self.cap or n <= 0:
            yield Held(self, n, 0)
            return
        n = min(n, self.cap)
        async with self._cond:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):  # distinct classes on Python 3.10
                await asyncio.wait_for(self._cond.wait_for(lambda: self.held + n <= self.cap), timeout_s)
            self.held += n
        held = Held(self, n, n)
        try:
            yield held
        finally:
            await held.give_back()

    async def release(self, n: int) -> None:
        """Give back ``n`` slots taken by :meth:`holding` (through its :class:`Held`, once)."""
        async with self._cond:
            self.held -= n
            self._cond.notify_all()


class Held:
    """Slots taken from a :class:`SlotGate`: ``n`` blocks may be asked for; :meth:`give_back` returns them once
    (a store's, as soon as its CommitStore is on the wire: the daemon frees them as it reads it, before any
    durable write)."""

    def __init__(self, gate: SlotGate, n: int, counted: int) -> None:
        self.n, self._gate, self._counted = n, gate, counted

    async def give_back(self) -> None:
        counted, self._counted = self._counted, 0
        if counted:
            await self._gate.release(counted)


class Reservation:
    """The G2 slots a PrepareStore reserved: one per block, ``None`` where nothing needs copying (stored
    already, or being stored by another session)."""

    def __init__(self, g2: Any, slots: list[int | None], nbytes: int) -> None:
        self.slots, self.nbytes, self._g2 = slots, nbytes, g2
        self.ok = True  # set False to give the slots back without storing
        self.ack: p.Ack | None = None  # the commit's answer, once the reservation is over

    def view(self, i: int) -> torch.Tensor | None:
        """Block ``i``'s slot bytes to copy into, or None when it needs no copy."""
        slot = self.slots[i]
        return None if slot is None else self._g2.slot_tensor(slot, self.nbytes)


@contextmanager
def reserving(client: Any, hashes: list[bytes], nbytes: int, *, durable: bool = False, namespace: str = "",
              partial: bool = False, covers: list[list[bytes]] | None = None) -> Iterator[Reservation]:
    """Reserve G2 slots for ``hashes`` and commit them when the body ends (``ok=False`` if it raised or set
    ``ok`` False; the commit's Ack is then ``ack``). Raises the daemon's DaemonError (a load code such as
    ``full`` means: skip this store). ``partial`` and ``covers``: :class:`kvbm.protocol.CommitStore`'s."""
    ns = namespace or client.namespace
    slots = client.request(p.PrepareStore(namespace=ns, hashes=hashes, nbytes=nbytes), p.Slots).slots
    res = Reservation(client.g2, slots, nbytes)
    try:
        yield res
    except BaseException:
        res.ok = False
        with contextlib.suppress(Exception):  # the body's error is the one that matters
            client.request(p.CommitStore(namespace=ns, hashes=hashes, ok=False), p.Ack)
        raise
    res.ack = client.request(p.CommitStore(namespace=ns, hashes=hashes, ok=res.ok, durable=durable and res.ok,
                                           partial=partial, covers=covers or []), p.Ack)


@asynccontextmanager
async def areserving(client: Any, hashes: list[bytes], nbytes: int, *, durable: bool = False,
                     namespace: str = "", sent: Callable[[], Awaitable[None]] | None = None,
                     partial: bool = False, covers: list[list[bytes]] | None = None) -> AsyncIterator[Reservation]:
    """:func:`reserving` for the asyncio client (``await client.request``); ``sent`` is awaited once the
    CommitStore is on the wire."""
    ns = namespace or client.namespace
    slots = (await client.request(p.PrepareStore(namespace=ns, hashes=hashes, nbytes=nbytes), p.Slots)).slots
    res = Reservation(client.g2, slots, nbytes)
    try:
        yield res
    except BaseException:
        res.ok = False
        with contextlib.suppress(Exception):  # the body's error is the one that matters
            await client.request(p.CommitStore(namespace=ns, hashes=hashes, ok=False), p.Ack)
        raise
    res.ack = await client.request(p.CommitStore(namespace=ns, hashes=hashes, ok=res.ok, durable=durable and res.ok,
                                                 partial=partial, covers=covers or []), p.Ack, sent=sent)


class Loaded:
    """The leading run of blocks an Onboard pinned: ``count`` blocks, each readable with :meth:`view`."""

    def __init__(self, g2: Any, reply: p.Onboarded) -> None:
        self.count, self.nbytes, self._g2, self.reply = reply.count, list(reply.nbytes[: reply.count]), g2, reply

    def view(self, i: int) -> torch.Tensor:
        return self._g2.slot_tensor(self.reply.slots[i], self.reply.nbytes[i])


class Onboarding:
    """An Onboard sent and not yet read, so several are in flight at once (the daemon brings their blocks up
    from disk or S3 together). :meth:`loaded` reads the reply and pins; leaving it sends the Release, whose
    reply :meth:`released` reads later (it needs no wait on the hot path)."""

    def __init__(self, client: Any, hashes: list[bytes], namespace: str = "") -> None:
        self.client, self.hashes, self.namespace = client, hashes, namespace or client.namespace
        self._msg = client.begin(p.Onboard(namespace=self.namespace, hashes=hashes))
        self._release: Any = None

    @contextmanager
    def loaded(self) -> Iterator[Loaded]:
        rep = self.client.finish(self._msg, p.Onboarded)
        token = self.client.token
        try:
            yield Loaded(self.client.g2, rep)
        finally:
            # Registered again since (another reply said the daemon forgot us): the pins went with the old
            # registration, and a Release under the new one would drop pins it took on the same keys.
            if rep.count and self.client.token == token:
                self._release = self.client.begin(p.Release(namespace=self.namespace, hashes=self.hashes[: rep.count]))

    def released(self) -> None:
        """Read the Release's reply (if one was sent)."""
        if self._release is not None:
            msg, self._release = self._release, None
            self.client.finish(msg, p.Released)


@contextmanager
def onboarded(client: Any, hashes: list[bytes], namespace: str = "") -> Iterator[Loaded]:
    """Onboard ``hashes``, yield the pinned leading run, release it when the body ends (not pipelined)."""
    job = Onboarding(client, hashes, namespace)
    try:
        with job.loaded() as got:
            yield got
    finally:
        job.released()


@asynccontextmanager
async def aonboarded(client: Any, hashes: list[bytes], namespace: str = "") -> AsyncIterator[Loaded]:
    """:func:`onboarded` for the asyncio client."""
    ns = namespace or client.namespace
    rep = await client.request(p.Onboard(namespace=ns, hashes=hashes), p.Onboarded)
    token = client.token
    try:
        yield Loaded(client.g2, rep)
    finally:
        if rep.count and client.token == token:  # (as :meth:`Onboarding.loaded`: pins are the registration's)
            await client.request(p.Release(namespace=ns, hashes=hashes[: rep.count]), p.Released)


class PendingLookup:
    """A Lookup sent and not yet read: every TP rank's (and every request's of a burst) are on the wire
    before the first reply is awaited."""

    def __init__(self, client: Any, hashes: list[bytes]) -> None:
        self.client = client
        self._msg = client.begin(p.Lookup(namespace=client.namespace, hashes=hashes))

    def matched(self) -> int:
        """The leading blocks the daemon holds."""
        return self.client.finish(self._msg, p.LookupReply).matched
