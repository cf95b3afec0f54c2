"""Prefix lookups off vLLM's scheduler thread: the scheduler asks, a background thread talks to the daemon.

A request's lookup is queued when it arrives (vLLM's ``on_new_request``), so its answer is usually there
by the time the scheduler reaches it: requests that arrive together are all answered for the same step.
The scheduler calls :meth:`Lookups.ask` from ``get_num_new_matched_tokens``; an answer not there yet is
waited for, but a step's asks wait at most ``wait_s`` (a few milliseconds) in all, and once one has waited in
vain the others of that step do not wait at all (the daemon is slow now: one wait per step, however many
requests ask). An answer still missing is ``None``: vLLM skips the request this step and asks again the
next. A lookup unanswered after ``give_up_s`` is a miss (the request is computed). An answer older than
``fresh_s`` (the request queued in vLLM a while) is asked again; if the new one is late the old one stands.

One thread owns every TP rank's link and sends a lookup to all ranks before awaiting any, so TP=8 costs one
round trip, not eight; lookups queued together are pipelined the same way. A link that fails answers its
lookups as misses at once and reconnects from this thread, never from the scheduler's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from kvbm.client.lease import PendingLookup, is_load
from kvbm.integrations.vllm.link import LINK_ERRORS, Link
from kvbm.integrations.vllm.stages import stages_of

log = logging.getLogger("kvbm.vllm")

# Lookups pipelined on one session at a time: well below the daemon's cap on a session's requests in flight
# (256), so a burst of new requests is sent in rounds rather than refused as a whole.
MAX_PIPELINED = 64
GAVE_UP_LOG_S = 10.0  # lookups given up are logged at most this often (with their count)


class Hit(NamedTuple):
    """A lookup's answer: what every rank holds."""

    blocks: int  # the leading kvbm blocks of the ones asked
    partial: int = 0  # the vLLM blocks of a partial block after them
    # Those vLLM blocks are the head of the stored block right after them (a prompt ending on a vLLM block's end
    # loads all of that block but its last vLLM block), not a partial block of their own.
    from_next: bool = False
    # Some rank's daemon did not answer (its link down or broken, or the lookup given up): the answer is a miss
    # because kvbm is unavailable, not because the blocks are not stored.
    degraded: bool = False


@dataclass
class _Job:
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
    stale: _Job | None = None  # the answer this job refreshes: it stands while this one is late
    refusals: int = 0  # times the daemon refused it as load (busy, full, shed): asked again, within give_up_s


class Lookups:
    """The scheduler's prefix lookups, answered by one background thread (see the module docstring)."""

    def __init__(self, links: list[Link], wait_s: float, give_up_s: float, idle_s: float = 0.25,
                 fresh_s: float = 1.0) -> None:
        self._links = links
        self.wait_s, self.give_up_s, self.idle_s, self.fresh_s = wait_s, give_up_s, idle_s, fresh_s
        self._budget = wait_s  # what asks of this step may still wait in all (scheduler thread only)
        self._jobs: dict[str, _Job] = {}  # asked and not yet returned (scheduler thread only)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.gave_up = 0
        self._gave_up_said = (0, -GAVE_UP_LOG_S)  # gave_up when last logged, and when (monotonic)
        self._stages = stages_of("scheduler")
        self._thread = threading.Thread(target=self._run, name="kvbm-lookup", daemon=True)
        self._thread.start()

    # Scheduler thread.
    def prefetch(self, req_id: str, hashes: list[bytes], vhashes: list[bytes] | None = None, k: int = 0,
                 next_block: bytes = b"") -> None:
        """Queue the lookup of a request that just arrived; :meth:`ask` returns its answer later."""
        if req_id not in self._jobs:
            self._queue_job(_Job(req_id, hashes, vhashes or [], k, next_block))

    def ask(self, req_id: str, hashes: list[bytes], vhashes: list[bytes] | None = None,
            k: int = 0, next_block: bytes = b"") -> Hit | None:
        """What every rank holds of ``hashes`` and the partial block after them, or None while that is not known
        yet. ``vhashes`` and ``k`` name the partial blocks to look for (none if empty), ``next_block`` the full
        block whose head is one too (see :class:`_Job`)."""
        job = self._jobs.get(req_id)
        vhashes = vhashes or []
        if job is None or job.hashes != hashes or job.vhashes != vhashes or job.next_block != next_block:
            job = self._queue_job(_Job(req_id, hashes, vhashes, k, next_block))
        elif job.done.is_set() and time.monotonic() - job.answered > self.fresh_s:
            job = self._queue_job(_Job(req_id, hashes, vhashes, k, next_block, stale=job))  # queued a while: again
        if not job.done.is_set() and self._budget > 0:
            t0 = time.monotonic()
            if job.done.wait(self._budget):
                self._budget -= time.monotonic() - t0  # asks answered in time share the step's budget
            else:
                self._budget = 0.0  # the daemon is slow now: the rest of this step does not wait
        if job.done.is_set():
            del self._jobs[req_id]
            return Hit(job.matched or 0, job.partial, job.from_next, job.degraded)
        if job.stale is not None:
            del self._jobs[req_id]  # the thread's late answer goes nowhere
            return Hit(job.stale.matched or 0, job.stale.partial, job.stale.from_next, job.stale.degraded)
        if time.monotonic() - job.asked > self.give_up_s:
            del self._jobs[req_id]
            self.gave_up += 1
            self._say_gave_up()
            return Hit(0, degraded=True)
        return None

    def _say_gave_up(self) -> None:
        """Log misses of lookups the daemon left unanswered (a recompute an operator should see), at most once per
        GAVE_UP_LOG_S."""
        said, at = self._gave_up_said
        now = time.monotonic()
        if now - at >= GAVE_UP_LOG_S:
            log.warning("kvbm: the daemon did not answer a lookup within %.0f ms: computed instead (%d such since "
                        "the last such line, %d in all)", self.give_up_s * 1000, self.gave_up - said, self.gave_up)
            self._gave_up_said = (self.gave_up, now)

    def _queue_job(self, job: _Job) -> _Job:
        self._jobs[job.req_id] = job
        self._queue.put(job)
        return job

    def new_step(self) -> None:
        """The next scheduler step starts: its asks may wait again."""
        self._budget = self.wait_s

    def forget(self, req_id: str) -> None:
        self._jobs.pop(req_id, None)

    def reset(self) -> None:
        """Forget every answer (a new weights epoch: they were for the old namespace); asks are sent again."""
        self._jobs.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # The lookup thread.
    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                try:
                    self._reconnect()
                except Exception as e:
                    log.warning("kvbm: reconnecting failed unexpectedly: %r", e)
                continue
            if job is None:
                return
            batch = [job]
            stop = False
            while len(batch) < MAX_PIPELINED:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                again = self._answer(batch)
                if again:
                    # Refused as load (a tenant's in-flight cap shared by its sessions, a burst): asked again after
                    # a short backoff instead of answered as misses; the scheduler never waits for it meanwhile.
                    time.sleep(min(0.05, 0.002 * 2 ** max(j.refusals for j in again)))
                    for j in again:
                        self._queue.put(j)
            except Exception as e:  # the thread must survive anything: a dead one would make every lookup wait
                log.warning("kvbm: lookups failed unexpectedly, answered as misses: %r", e)
                now = time.monotonic()
                for j in batch:
                    if not j.done.is_set():
                        j.matched, j.answered = 0, now
                        j.done.set()
            if stop:
                return

    def _reconnect(self) -> None:
        """Bring links that are down back up (each retries on its own backoff)."""
        for link in self._links:
            if link.client is None:
                link.get()

    def _answer(self, batch: list[_Job]) -> list[_Job]:
        """Answer ``batch``; the jobs the daemon refused as load and that are young enough to ask again."""
        matched = [len(job.hashes) for job in batch]
        refused: set[int] = set()
        broken: set[int] = set()  # jobs some rank's link could not answer
        sent: list[tuple[Link, list[PendingLookup | None]]] = []
        for link in self._links:  # every rank's lookups are sent before any reply is awaited
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
        again = [batch[i] for i in sorted(refused) if now - batch[i].asked < self.give_up_s / 2]
        for job in again:
            job.refusals += 1
        retry = {id(j) for j in again}
        partial = self._partials(batch, matched)
        for i, (job, m, (j, from_next)) in enumerate(zip(batch, matched, partial, strict=True)):
            if id(job) in retry:
                continue
            job.matched, job.partial, job.from_next, job.answered = m, j, from_next, now
            job.degraded = i in broken or i in refused  # a miss kvbm could not answer
            self._stages.add(lookups=1, lookup_ms=(now - job.asked) * 1e3)  # queued + round trip, every rank
            job.done.set()
        return again

    def _partials(self, batch: list[_Job], matched: list[int]) -> list[tuple[int, bool]]:
        """For each job, the longest partial block every rank holds right after its ``matched`` full blocks (its
        vLLM blocks, 0: none; and whether it is the head of the job's ``next_block``). One more round trip, every
        candidate of every job pipelined on every link."""
        cands = [_candidates(job, m) for job, m in zip(batch, matched, strict=True)]
        found: list[tuple[int, bool]] = [(0, False)] * len(batch)
        if not any(cands):
            return found
        held = [[True] * len(c) for c in cands]
        sent: list[tuple[Link, list[list[PendingLookup]]]] = []
        for link in self._links:
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
            found[i] = next(((j, full) for (_, j, full), ok in zip(cands[i], h, strict=True) if ok), (0, False))
        return found


def _candidates(job: _Job, m: int) -> list[tuple[bytes, int, bool]]:
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
