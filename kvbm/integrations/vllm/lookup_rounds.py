"""The lookup thread's round trips (:mod:`~kvbm.integrations.vllm.lookup`): a batch of prefix lookups on every
rank's link, then the partial blocks that may continue each run, all pipelined."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvbm.client.lease import PendingLookup, is_load
from kvbm.integrations.vllm.link import LINK_ERRORS, Link
from kvbm.integrations.vllm.pins import KEEP_S, Pinned
from kvbm.integrations.vllm.stages import Stages


@dataclass
class Job:
    req_id: str
    hashes: list[bytes]
    # A partial block's candidates: the request's vLLM block hashes (as many as may be loaded) and k. The
    # partial block that continues a run of m full blocks with j vLLM blocks is keyed by vhashes[m*k + j - 1].
    vhashes: list[bytes] = field(default_factory=list)
    k: int = 0
    # The block keyed by the vLLM block right after the loadable ones (a prompt ending on a vLLM block's end: vLLM
    # computes that last block): a full block, or a partial block one vLLM block longer than the loadable ones. Its
    # head (all but its last vLLM block) is a partial block's candidate too.
    next_block: bytes = b""
    asked: float = field(default_factory=time.monotonic)
    matched: int | None = None  # kvbm blocks every rank holds, once answered
    partial: int = 0  # and the vLLM blocks of the partial block every rank holds after them
    from_next: bool = False  # those are the head of ``next_block``
    degraded: bool = False  # some rank's link was down or broke while answering it
    answered: float = 0.0  # when it was (monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    stale: Job | None = None  # the answer this job refreshes: it stands while this one is late
    refusals: int = 0  # times the daemon refused it as load (busy, full, shed): asked again, within give_up_s
    partial_key: bytes = b""  # the key of the partial block every rank holds (``partial`` > 0)
    pin_from: int = -1  # pin the matched blocks from this one on, and the partial block (-1: do not pin)
    pinned_from: int = -1  # the ``pin_from`` the thread pinned for (-1: not pinned), whatever it could pin
    pinned_at: float = 0.0  # when (monotonic)
    repinned: bool = False  # pinned again when asked (a prefetch's pins were refused, or kept too long)
    pins: Pinned | None = None  # what the thread pinned, until ask hands it over
    wanted: bool = False  # vLLM asked for it (not only a prefetch at arrival): its pins wait for room
    room_step: int = -1  # the engine step its pins were first refused as load at (-1: never)
    room_at: float = 0.0  # and when (monotonic)
    forgotten: bool = False  # dropped by the scheduler: pins the thread takes after that are released at once


# A sync hit refused room for its pins waits this many engine steps for it (and at most ROOM_MAX_S), then is answered
# with what it pinned: the steps that copy other requests' pins release them.
ROOM_STEPS = 32
ROOM_MAX_S = 10.0


class RoomWait:
    """Whether a job whose pins were refused as load (the pool or the session's budget full of other requests' pins,
    the daemon busy) is asked again rather than answered with what it pinned: while the engine has run fewer than
    ``ROOM_STEPS`` steps with tokens (empty steps free nothing) and ``ROOM_MAX_S`` since its first refusal. Room
    frees as the steps that copy the pinned requests run, so it is counted in steps: a slow engine's steps (a CPU
    forward of a second) are waited for, as answering short costs a recompute of the hit, seconds on such an
    engine."""

    def __init__(self) -> None:
        self.steps = 0  # the engine's steps so far (the scheduler thread counts, the lookup thread reads: an int)

    def step(self) -> None:
        self.steps += 1

    def waits(self, job: Job) -> bool:
        now = time.monotonic()
        if job.room_step < 0:
            job.room_step, job.room_at = self.steps, now
        if self.steps - job.room_step >= ROOM_STEPS or now - job.room_at >= ROOM_MAX_S:
            return False
        job.asked = now  # a silent daemon is given up on from this round on, not the room it waits for
        return True


def pins_stale(job: Job) -> bool:
    """Whether a job's pins are worth taking again before they are used, once: refused or short of room at arrival
    (a prefetch does not wait for room: other requests' pins filled the pool or the session's budget then), or kept
    past ``KEEP_S`` (the daemon may drop a silent session's pins)."""
    pins = job.pins
    if pins is None or job.repinned:
        return False
    short = (pins.refused or pins.short) and pins.count < len(pins.keys)
    return short or time.monotonic() - job.pinned_at > KEEP_S


def look(links: list[Link], batch: list[Job], give_up_s: float, stages: Stages) -> list[Job]:
    """Look ``batch`` up (answers set, not marked done); the jobs refused as load and young enough to ask
    again."""
    matched = [len(job.hashes) for job in batch]
    refused: set[int] = set()
    broken: set[int] = set()  # jobs some rank's link could not answer
    sent: list[tuple[Link, list[PendingLookup | None]]] = []
    for link in links:  # every rank's lookups are sent before any reply is awaited
        client = link.get()
        if client is None:
            matched = [0] * len(batch)
            broken.update(range(len(batch)))
            continue
        try:
            # A job with no full block to look up asks for its partial block only (below).
            msgs = [PendingLookup(client, job.hashes) if job.hashes else None for job in batch]
        except LINK_ERRORS as e:
            link.error(e)
            matched = [0] * len(batch)
            broken.update(range(len(batch)))
            continue
        sent.append((link, msgs))
    for link, msgs in sent:
        for i, msg in enumerate(msgs):
            if msg is None:
                continue
            try:
                matched[i] = min(matched[i], msg.matched())
            except LINK_ERRORS as e:
                link.error(e)
                matched[i] = 0
                if is_load(e):
                    refused.add(i)
                else:
                    broken.add(i)
                if link.client is None:  # the session is gone, and with it the replies still due
                    for j in range(i + 1, len(msgs)):
                        matched[j] = 0
                    broken.update(range(i + 1, len(msgs)))
                    break
    now = time.monotonic()
    again = [batch[i] for i in sorted(refused) if now - batch[i].asked < give_up_s / 2]
    for job in again:
        job.refusals += 1
    retry = {id(j) for j in again}
    partial = partials(links, batch, matched)
    for i, (job, m, (j, from_next, key)) in enumerate(zip(batch, matched, partial, strict=True)):
        if id(job) in retry:
            continue
        job.matched, job.partial, job.from_next, job.partial_key, job.answered = m, j, from_next, key, now
        job.degraded = i in broken or i in refused  # a miss kvbm could not answer
        stages.add(lookups=1, lookup_ms=(now - job.asked) * 1e3)  # queued + round trip, every rank
    return again


def partials(links: list[Link], batch: list[Job], matched: list[int]) -> list[tuple[int, bool, bytes]]:
    """For each job, the longest partial block every rank holds right after its ``matched`` full blocks (its
    vLLM blocks, 0: none; whether it is the head of the job's ``next_block``; its key). One more round trip,
    every candidate of every job pipelined on every link."""
    cands = [candidates(job, m) for job, m in zip(batch, matched, strict=True)]
    found: list[tuple[int, bool, bytes]] = [(0, False, b"")] * len(batch)
    if not any(cands):
        return found
    held = [[True] * len(c) for c in cands]
    sent: list[tuple[Link, list[list[PendingLookup]]]] = []
    for link in links:
        client = link.get()
        if client is None:
            return found
        try:
            sent.append((link, [[PendingLookup(client, [h]) for h, _, _ in c] for c in cands]))
        except LINK_ERRORS as e:
            link.error(e)
            return found
    for link, msgs in sent:
        for i, per_job in enumerate(msgs):
            for c, msg in enumerate(per_job):
                if link.client is None:  # the session is gone, and with it the replies still due
                    held[i][c] = False
                    continue
                try:
                    ok = msg.matched() == 1  # read every reply, whatever the others said
                    held[i][c] = held[i][c] and ok
                except LINK_ERRORS as e:
                    link.error(e)
                    held[i][c] = False
    for i, h in enumerate(held):
        found[i] = next(((j, full, key) for (key, j, full), ok in zip(cands[i], h, strict=True) if ok),
                        (0, False, b""))
    return found


def candidates(job: Job, m: int) -> list[tuple[bytes, int, bool]]:
    """The blocks that may continue ``job``'s run of ``m`` full blocks, longest first: (key, vLLM blocks, the head
    of the next block). A partial block of j vLLM blocks is keyed by ``vhashes[m*k + j - 1]``. Where the request
    has one more vLLM block past the loadable ones (a prompt ending on a vLLM block's end), the block it keys (the
    next full block, or a partial block of ``room + 1``: what a first run of this prompt stored) holds the
    loadable ones as its head: a candidate right after the partial block of as many (which holds exactly those
    bytes, no more)."""
    k = job.k
    if k <= 1 or m < 0:
        return []
    room = len(job.vhashes) - m * k
    out = [(job.vhashes[m * k + j - 1], j, False) for j in range(min(k - 1, room), 0, -1)]
    if job.next_block and 0 < room < k:
        out.insert(1, (job.next_block, room, True))
    return out
