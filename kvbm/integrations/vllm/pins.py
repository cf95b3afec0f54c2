"""A synchronous load's blocks, pinned in G2 at lookup time so the engine's step only copies.

A synchronous load runs on vLLM's engine thread before the forward. If it asked the daemon for its blocks there
(Onboard), every step with a hit would wait on a round trip, on blocks coming up from disk or S3, and, with the
daemon stopped, on the link's timeout. Instead the scheduler's lookup thread pins them when vLLM is about to
schedule the request (the request is skipped until they are pinned), the load names each block's G2 slot, and the
worker copies out of its own mapping of the pool: nothing on the step waits on the daemon. Pins are released on the
lookup thread once the step that copied them has run (the worker says so in its step output), or when the request
goes before its load was scheduled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kvbm import protocol as p
from kvbm.client.lease import is_load
from kvbm.integrations.vllm.link import LINK_ERRORS, Link

log = logging.getLogger("kvbm.vllm")


class _HasPins(Protocol):
    @property
    def pins(self) -> Pinned: ...


H = TypeVar("H", bound=_HasPins)
# Steps vLLM may have planned and not run yet (async scheduling runs one ahead, pipeline parallelism one per stage):
# pins of a step this far back are released whatever the workers said.
STEPS_IN_FLIGHT = 64
# A request's pins kept while it waits in vLLM's queue are asked again after this: well inside the daemon's lease of
# a silent session (worker_timeout_s, 60 s), after which it may free them.
KEEP_S = 20.0


@dataclass
class RankPins:
    """What one rank's scheduler session pinned: its leading ``count`` keys, in the pool of ``generation``."""

    generation: str
    slots: list[int]
    nbytes: list[int]
    client: Any = field(default=None, repr=False, compare=False)  # the session holding them (not sent)
    held: int = -1  # the leading keys the daemon holds in any tier (-1: unsaid): more than pinned, short of room
    token: str = field(default="", repr=False, compare=False)  # the registration that took them (not sent)

    def releasable(self, link: Link) -> bool:
        """Whether the registration that took these pins is still the link's: a session that registered again
        in place (the daemon restarted, or let its lease run out) lost them, and a Release under its new
        registration would drop the pins it took since, on the same keys, for another request."""
        c = self.client
        return bool(self.count) and link.client is c and c.token == self.token and c.generation == self.generation

    @property
    def count(self) -> int:
        return len(self.slots)


@dataclass
class Pinned:
    """A request's pinned run: ``keys`` asked, per rank what its session pinned (None: that rank's link failed)."""

    keys: list[bytes]
    ranks: list[RankPins | None]
    refused: bool = False  # some rank's daemon refused as load (its slots full, busy): asked again, or a miss
    cut: bool = False  # ``keys`` are the head of a longer hit, cut at the pin window (the rest is not pinned)

    @property
    def short(self) -> bool:
        """Some rank pinned fewer keys than its daemon holds (no room for them now: asking later may pin more)."""
        return any(r is not None and r.count < r.held for r in self.ranks)

    @property
    def count(self) -> int:
        """The leading keys every rank pinned."""
        return min((r.count if r is not None else 0 for r in self.ranks), default=0)

    def slots_for(self, hashes: list[bytes]) -> dict[int, tuple[str, list[int], list[int]]]:
        """Per rank (in the links' order), ``hashes``' slots: (generation, slots, nbytes), as far as every one of
        ``hashes`` is pinned on every rank; empty if none is."""
        index = {h: i for i, h in enumerate(self.keys[: self.count])}
        idx = []
        for h in hashes:
            if h not in index:
                break
            idx.append(index[h])
        if not idx:
            return {}
        return {r: (rp.generation, [rp.slots[i] for i in idx], [rp.nbytes[i] for i in idx])
                for r, rp in enumerate(self.ranks) if rp is not None}


def pin_all(links: list[Link], runs: list[list[bytes]]) -> list[Pinned]:
    """Onboard each run of keys on every rank's link (all sent before any reply is read) and keep the pins. A
    rank whose link fails pins nothing; a refusal as load is marked (``refused``)."""
    out = [Pinned(keys, [None] * len(links)) for keys in runs]
    sent: list[tuple[int, Link, Any, list[p.Onboard]]] = []
    for r, link in enumerate(links):
        client = link.get()
        if client is None:
            continue
        try:
            sent.append((r, link, client, [client.begin(p.Onboard(namespace=client.namespace, hashes=keys))
                                           for keys in runs]))
        except LINK_ERRORS as e:
            link.error(e)
    for r, link, client, msgs in sent:
        for pinned, msg in zip(out, msgs, strict=True):
            if link.client is not client:
                break  # the session is gone, and its pins with it
            try:
                rep = client.finish(msg, p.Onboarded)
            except LINK_ERRORS as e:
                pinned.refused = pinned.refused or is_load(e)
                link.error(e)
                continue
            pinned.ranks[r] = RankPins(client.generation, list(rep.slots[: rep.count]), list(rep.nbytes[: rep.count]),
                                       client, rep.held, client.token)
    return out


def release_all(links: list[Link], pinned: Pinned) -> None:
    """Release what each rank's session pinned (a session that is gone released them with it)."""
    sent: list[tuple[Link, Any, p.Release]] = []
    for link, rp in zip(links, pinned.ranks, strict=True):
        if rp is None or not rp.releasable(link):
            continue
        try:
            sent.append((link, rp.client,
                         rp.client.begin(p.Release(namespace=rp.client.namespace, hashes=pinned.keys[: rp.count]))))
        except LINK_ERRORS as e:
            link.error(e)
    for link, client, msg in sent:
        if link.client is not client:
            continue
        try:
            client.finish(msg, p.Released)
        except LINK_ERRORS as e:
            link.error(e)


class PinBook(Generic[H]):
    """The scheduler's side of the pins: a request's pinned hit (``H``: anything with ``pins``) until its load is
    handed to a step, then the step's pins until a worker says it copied them. ``release`` hands pins to the lookup
    thread, which sends the Releases."""

    def __init__(self, release: Callable[[Pinned], None]) -> None:
        self._release = release
        # request -> (what was asked, its hit, when it was pinned)
        self._waiting: dict[str, tuple[tuple[int, int, int], H, float]] = {}
        self._handed: dict[int, list[Pinned]] = {}  # step -> pins its loads copy

    def keep(self, req_id: str, asked: tuple[int, int, int], hit: H) -> None:
        """``req_id``'s hit is pinned; asked the same again before its load is scheduled, :meth:`kept` serves it."""
        was = self._waiting.pop(req_id, None)
        if was is not None and was[1] is not hit:
            self._release(was[1].pins)
        self._waiting[req_id] = (asked, hit, was[2] if was is not None and was[1] is hit else time.monotonic())

    def kept(self, req_id: str, asked: tuple[int, int, int]) -> H | None:
        """The hit kept for ``req_id`` if it was asked as ``asked`` and pinned less than ``KEEP_S`` ago (taken:
        :meth:`keep` it again if still wanted); other pins of it are released."""
        was = self._waiting.get(req_id)
        if was is not None and was[0] == asked and time.monotonic() - was[2] < KEEP_S:
            return was[1]
        was = self._waiting.pop(req_id, None)
        if was is not None:
            self._release(was[1].pins)
        return None

    def drop(self, req_id: str) -> None:
        """``req_id`` goes, or asks for other blocks: its pins no step was handed are released."""
        was = self._waiting.pop(req_id, None)
        if was is not None:
            self._release(was[1].pins)

    def hand(self, req_id: str, step: int) -> None:
        """``req_id``'s load goes to ``step``: its pins stay until that step is over."""
        was = self._waiting.pop(req_id, None)
        if was is not None:
            self._handed.setdefault(step, []).append(was[1].pins)

    def pins_of(self, req_id: str) -> Pinned | None:
        was = self._waiting.get(req_id)
        return was[1].pins if was is not None else None

    def copied(self, steps: set[int]) -> None:
        """Workers copied these steps' loads: steps run in order, so every step up to the last is over."""
        last = max(steps, default=-1)
        for s in [s for s in self._handed if s <= last]:
            for pins in self._handed.pop(s):
                self._release(pins)

    def expire(self, step: int) -> None:
        """``step`` is being planned: a step ``STEPS_IN_FLIGHT`` before it ran long ago (vLLM plans at most a few
        ahead of what runs), so its pins go even if no worker said so (an engine whose outputs dropped it)."""
        self.copied({step - STEPS_IN_FLIGHT})

    def clear(self) -> None:
        """A new weights epoch: pins no step was handed are of the old one."""
        for req_id in list(self._waiting):
            self.drop(req_id)
