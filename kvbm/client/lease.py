"""Slot leases, the worker's side: G2 slots reserved for a store, or pinned by a load, each given back once.

A store is PrepareStore -> copy into the reserved slots -> CommitStore; a load is Onboard -> copy out of the
pinned slots -> Release. :func:`reserving` and :class:`Onboarding` own those sequences, so a caller only
copies: whatever happens in its body, the daemon is told (a failed copy commits ``ok=False``, which frees the
slots; a load's pins are released). The daemon states how many slots one session may hold at once in
``Registered``; :func:`pin_window` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvbm import protocol as p


def pin_window(registered: p.Registered | None) -> int:
    """How many G2 slots this session may hold pinned or reserved at once: the daemon's per-session budget,
    else half the pool (a daemon that does not state one: the other half stays for other sessions)."""
    if registered is None:
        return 1
    stated = int(getattr(registered, "session_slots", 0) or 0)
    return max(1, stated if stated > 0 else registered.num_slots // 2)


class Reservation:
    """The G2 slots a PrepareStore reserved: one per block, ``None`` where nothing needs copying (stored
    already, or being stored by another session)."""

    def __init__(self, g2: Any, slots: list[int | None], nbytes: int) -> None:
        self.slots, self.nbytes, self._g2 = slots, nbytes, g2
        self.ok = True  # set False to give the slots back without storing

    def view(self, i: int) -> torch.Tensor | None:
        """Block ``i``'s slot bytes to copy into, or None when it needs no copy."""
        slot = self.slots[i]
        return None if slot is None else self._g2.slot_tensor(slot, self.nbytes)


@contextmanager
def reserving(client: Any, hashes: list[bytes], nbytes: int, *, durable: bool = False) -> Iterator[Reservation]:
    """Reserve G2 slots for ``hashes`` and commit them when the body ends (``ok=False`` if it raised or set
    ``ok`` False). Raises the daemon's DaemonError (a load code such as ``full`` means: skip this store)."""
    ns = client.namespace
    slots = client.request(p.PrepareStore(namespace=ns, hashes=hashes, nbytes=nbytes), p.Slots).slots
    res = Reservation(client.g2, slots, nbytes)
    try:
        yield res
    except BaseException:
        res.ok = False
        raise
    finally:
        client.request(p.CommitStore(namespace=ns, hashes=hashes, ok=res.ok, durable=durable and res.ok), p.Ack)


class Loaded:
    """The leading run of blocks an Onboard pinned: ``count`` blocks, each readable with :meth:`view`."""

    def __init__(self, g2: Any, reply: p.Onboarded) -> None:
        self.count, self.nbytes, self._g2, self._reply = reply.count, list(reply.nbytes[: reply.count]), g2, reply

    def view(self, i: int) -> torch.Tensor:
        return self._g2.slot_tensor(self._reply.slots[i], self._reply.nbytes[i])


class Onboarding:
    """An Onboard sent and not yet read, so several are in flight at once (the daemon brings their blocks up
    from disk or S3 together). :meth:`loaded` reads the reply and pins; leaving it sends the Release, whose
    reply :meth:`released` reads later (it needs no wait on the hot path)."""

    def __init__(self, client: Any, hashes: list[bytes]) -> None:
        self.client, self.hashes = client, hashes
        self._msg = client.begin(p.Onboard(namespace=client.namespace, hashes=hashes))
        self._release: Any = None

    @contextmanager
    def loaded(self) -> Iterator[Loaded]:
        rep = self.client.finish(self._msg, p.Onboarded)
        try:
            yield Loaded(self.client.g2, rep)
        finally:
            if rep.count:
                self._release = self.client.begin(p.Release(namespace=self.client.namespace,
                                                            hashes=self.hashes[: rep.count]))

    def released(self) -> None:
        """Read the Release's reply (if one was sent)."""
        if self._release is not None:
            msg, self._release = self._release, None
            self.client.finish(msg, p.Released)


@contextmanager
def onboarded(client: Any, hashes: list[bytes]) -> Iterator[Loaded]:
    """Onboard ``hashes``, yield the pinned leading run, release it when the body ends (not pipelined)."""
    job = Onboarding(client, hashes)
    try:
        with job.loaded() as got:
            yield got
    finally:
        job.released()
