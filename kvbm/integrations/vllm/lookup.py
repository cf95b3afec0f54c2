"""Prefix lookups off vLLM's scheduler thread: the scheduler asks, a background thread talks to the daemon.

A request's lookup is queued when it arrives (vLLM's ``on_new_request``), so its answer is usually there
by the time the scheduler reaches it: requests that arrive together are all answered for the same step.
The scheduler calls :meth:`Lookups.ask` from ``get_num_new_matched_tokens``; an answer not there yet is
waited for, but a step's asks wait at most ``wait_s`` (a few milliseconds) in all, and once one has waited in
vain the others of that step do not wait at all (the daemon is slow now: one wait per step, however many
requests ask). An answer still missing is ``None``: vLLM skips the request this step and asks again the
next. A lookup unanswered after ``give_up_s`` is a miss (the request is computed). An answer older than
``fresh_s`` (the request queued in vLLM a while) is asked again; if the new one is late the old one stands.
A synchronous load's pins, once its lookup is answered, are waited for up to the links' request timeout (they
bring blocks up from disk or S3), and pins refused room (other requests' pins fill the pool or the session's
budget) are asked again as the steps that copy those run (``lookup_rounds.RoomWait``): a recompute of the hit
costs more than either wait, and vLLM schedules other requests meanwhile.

One thread owns every TP rank's link and sends a lookup to all ranks before awaiting any, so TP=8 costs one
round trip, not eight; lookups queued together are pipelined the same way. A link that fails answers its
lookups as misses at once and reconnects from this thread, never from the scheduler's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

from kvbm.client.lease import pin_window
from kvbm.integrations.vllm.link import Link
from kvbm.integrations.vllm.lookup_rounds import Job, RoomWait, look, pins_stale
from kvbm.integrations.vllm.pins import Pinned, pin_all, release_all
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
    # Asked with ``pin_from`` (a synchronous load): the blocks from that one on and the partial block, pinned in
    # G2 for the load (:mod:`~kvbm.integrations.vllm.pins`); the caller owns them and releases them.
    pins: Pinned | None = None


class Lookups:
    """The scheduler's prefix lookups, answered by one background thread (see the module docstring)."""

    def __init__(self, links: list[Link], wait_s: float, give_up_s: float, idle_s: float = 0.25,
                 fresh_s: float = 1.0) -> None:
        self._links = links
        self.wait_s, self.give_up_s, self.idle_s, self.fresh_s = wait_s, give_up_s, idle_s, fresh_s
        self._budget = wait_s  # what asks of this step may still wait in all (scheduler thread only)
        self._room = RoomWait()  # pins refused room wait for it, counted in the engine's steps
        self._pin_timeout_s = max((link.timeout_s for link in links), default=give_up_s)
        self._jobs: dict[str, Job] = {}  # asked and not yet returned (scheduler thread only)
        self._queue: queue.SimpleQueue[Job | Pinned | None] = queue.SimpleQueue()  # Pinned: to release
        self._lock = threading.Lock()  # a job's pins and ``forgotten``, between the thread and the scheduler
        self.gave_up = 0
        self._gave_up_said = (0, -GAVE_UP_LOG_S)  # gave_up when last logged, and when (monotonic)
        self._stages = stages_of("scheduler")
        self._thread = threading.Thread(target=self._run, name="kvbm-lookup", daemon=True)
        self._thread.start()

    # Scheduler thread.
    def prefetch(self, req_id: str, hashes: list[bytes], vhashes: list[bytes] | None = None, k: int = 0,
                 next_block: bytes = b"", pin_from: int = -1) -> None:
        """Queue the lookup of a request that just arrived (pinned from ``pin_from`` on, if >= 0); :meth:`ask`
        returns its answer later."""
        if req_id not in self._jobs:
            self._queue_job(Job(req_id, hashes, vhashes or [], k, next_block, pin_from=pin_from))

    def ask(self, req_id: str, hashes: list[bytes], vhashes: list[bytes] | None = None,
            k: int = 0, next_block: bytes = b"", pin_from: int = -1) -> Hit | None:
        """What every rank holds of ``hashes`` and the partial block after them, or None while that is not known
        yet. ``vhashes`` and ``k`` name the partial blocks to look for (none if empty), ``next_block`` the full
        block whose head is one too (see :class:`Job`). With ``pin_from`` >= 0 the answer comes once the held
        blocks from that one on are pinned too (:attr:`Hit.pins`)."""
        job = self._jobs.get(req_id)
        if job is not None:
            job.wanted = True  # vLLM is about to schedule it: its pins wait for room (a prefetch's do not)
        vhashes = vhashes or []
        if job is None or job.hashes != hashes or job.vhashes != vhashes or job.next_block != next_block:
            job = self._queue_job(Job(req_id, hashes, vhashes, k, next_block, pin_from=pin_from, wanted=True))
        elif pin_from >= 0 and job.done.is_set() and (job.pinned_from != pin_from or pins_stale(job)):
            self._repin(job, pin_from)  # answered without pins, pinned from another block, or pinned long ago
        elif pin_from >= 0:
            job.pin_from = pin_from  # not answered yet: the thread pins it after its lookup (or the next ask does)
        elif job.done.is_set() and time.monotonic() - job.answered > self.fresh_s:
            job = self._queue_job(Job(req_id, hashes, vhashes, k, next_block, stale=job))  # queued a while: again
        if not job.done.is_set() and self._budget > 0 and job.room_step < 0:  # waiting for room: not this step
            t0 = time.monotonic()
            if job.done.wait(self._budget):
                self._budget -= time.monotonic() - t0  # asks answered in time share the step's budget
            else:
                self._budget = 0.0  # the daemon is slow now: the rest of this step does not wait
        if job.done.is_set() and pin_from >= 0 and job.pinned_from != pin_from:
            self._repin(job, pin_from)  # the thread answered it before it saw pin_from
            return None
        if job.done.is_set():
            del self._jobs[req_id]
            pins, job.pins = job.pins, None
            return Hit(job.matched or 0, job.partial, job.from_next, job.degraded, pins)
        if job.stale is not None and pin_from < 0:
            del self._jobs[req_id]  # the thread's late answer goes nowhere
            return Hit(job.stale.matched or 0, job.stale.partial, job.stale.from_next, job.stale.degraded)
        if time.monotonic() - job.asked > (deadline := self._deadline(job)):
            self.forget(req_id)
            self.gave_up += 1
            self._say_gave_up(deadline)
            return Hit(0, degraded=True)
        return None

    def _deadline(self, job: Job) -> float:
        """How long ``job`` is waited for: ``give_up_s`` for its lookup; once the daemon answered that, its pins
        (Onboards bringing blocks up from disk or S3, real work: answering short would cost a recompute of the hit)
        get the links' request timeout, which also bounds each of their round trips on the lookup thread."""
        if job.pin_from >= 0 and job.matched is not None:
            return max(self.give_up_s, self._pin_timeout_s)
        return self.give_up_s

    def _repin(self, job: Job, pin_from: int) -> None:
        """Pin an answered job's held blocks from ``pin_from`` on (what it pinned before is released); it has
        ``give_up_s`` from now."""
        self._unpin(job)
        job.repinned = job.pinned_from >= 0
        job.pin_from, job.pinned_from, job.refusals, job.room_step = pin_from, -1, 0, -1
        job.asked = time.monotonic()
        job.done.clear()
        self._queue.put(job)

    def _say_gave_up(self, deadline_s: float) -> None:
        """Log misses of lookups the daemon left unanswered (a recompute an operator should see), at most once per
        GAVE_UP_LOG_S."""
        said, at = self._gave_up_said
        now = time.monotonic()
        if now - at >= GAVE_UP_LOG_S:
            log.warning("kvbm: the daemon did not answer a lookup within %.0f ms: computed instead (%d such since "
                        "the last such line, %d in all)", deadline_s * 1000, self.gave_up - said, self.gave_up)
            self._gave_up_said = (self.gave_up, now)

    def _queue_job(self, job: Job) -> Job:
        self.forget(job.req_id)  # a job it replaces: its pins, if any, are released
        self._jobs[job.req_id] = job
        self._queue.put(job)
        return job

    def new_step(self, busy: bool = True) -> None:
        """The next scheduler step starts: its asks may wait again. ``busy``: the step ran tokens (so its copies
        release pins: what a request waiting for room counts)."""
        self._budget = self.wait_s
        if busy:
            self._room.step()

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s job; what it pinned is released (by the thread, if it is still pinning)."""
        job = self._jobs.pop(req_id, None)
        if job is not None:
            with self._lock:
                job.forgotten = True
                pins, job.pins = job.pins, None
            if pins is not None:
                self.release(pins)

    def _unpin(self, job: Job) -> None:
        """Release what an answered job pinned (the thread is done with it)."""
        pins, job.pins = job.pins, None
        if pins is not None:
            self.release(pins)

    def release(self, pins: Pinned) -> None:
        """Release ``pins`` (from any thread): the lookup thread sends the Releases."""
        self._queue.put(pins)

    def reset(self) -> None:
        """Forget every answer (a new weights epoch: they were for the old namespace); asks are sent again."""
        for rid in list(self._jobs):
            self.forget(rid)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # The lookup thread.
    def _run(self) -> None:
        # Jobs the daemon refused as load (room for their pins, busy): asked again after a short backoff, or at once
        # when pins are released (room for them is what frees). The scheduler never waits for them meanwhile.
        parked: list[Job] = []
        retry_at = 0.0
        while True:
            try:
                items: list[Job | Pinned | None] = [self._queue.get(
                    timeout=max(0.0, retry_at - time.monotonic()) if parked else self.idle_s)]
            except queue.Empty:
                if not parked:
                    try:
                        self._reconnect()
                    except Exception as e:
                        log.warning("kvbm: reconnecting failed unexpectedly: %r", e)
                    continue
                items = []
            while items and items[-1] is not None and len(items) < MAX_PIPELINED:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = bool(items) and items[-1] is None
            releases = [i for i in items if isinstance(i, Pinned)]
            batch = [j for j in items if isinstance(j, Job)]
            if parked and (releases or time.monotonic() >= retry_at):
                room = max(1, MAX_PIPELINED - len(batch))  # a round stays within what one session may have in flight
                batch, parked = batch + parked[:room], parked[room:]
            try:
                for pins in releases:
                    self._release(pins)  # first: the slots they hold may be what the next pins need
                again = self._answer(batch) if batch else []
                if again:
                    parked += again
                    retry_at = time.monotonic() + min(0.05, 0.002 * 2 ** max(j.refusals for j in again))
            except Exception as e:  # the thread must survive anything: a dead one would make every lookup wait
                log.warning("kvbm: lookups failed unexpectedly, answered as misses: %r", e)
                now = time.monotonic()
                for j in batch:
                    if not j.done.is_set():
                        j.matched, j.answered = 0, now
                        j.done.set()
            if stop:
                for j in parked:
                    j.done.set()
                return

    def _release(self, pins: Pinned) -> None:
        try:
            release_all(self._links, pins)
        except Exception as e:  # one failure must not keep the others' pins
            log.warning("kvbm: releasing pins failed unexpectedly: %r", e)

    def _reconnect(self) -> None:
        """Bring links that are down back up (each retries on its own backoff)."""
        for link in self._links:
            link.drop_if_lost()  # a daemon gone while idle: its G2 pool is unmapped now (a restart needs it)
            if link.client is None:
                link.get()

    def _answer(self, batch: list[Job]) -> list[Job]:
        """Answer ``batch`` (look up the jobs not answered yet, then pin what the pinning ones hold); the jobs the
        daemon refused as load and that are young enough to ask again."""
        fresh = [j for j in batch if j.matched is None]
        again = look(self._links, fresh, self.give_up_s, self._stages) if fresh else []
        retry = {id(j) for j in again}
        ready = [j for j in batch if id(j) not in retry]
        again += self._pin([j for j in ready if j.pin_from >= 0 and not j.forgotten])
        retry = {id(j) for j in again}
        for job in ready:
            if id(job) not in retry:
                job.done.set()
        return again

    def _pin(self, jobs: list[Job]) -> list[Job]:
        """Pin each job's held blocks from its ``pin_from`` on (every job's Onboards pipelined on every link); the
        jobs refused as load while young enough to ask again (what they pinned is released)."""
        now = time.monotonic()
        for j in jobs:
            j.pinned_from, j.pinned_at = j.pin_from, now  # read once: the scheduler may ask from another block
        # At most a pin window per request (half the pool, the session's budget): a longer hit's rest is brought
        # up in the step, as before (kvbm.integrations.vllm.loads).
        window = min((pin_window(link.client.registered) for link in self._links if link.client is not None),
                     default=1)
        keys = [j.hashes[j.pinned_from : j.matched or 0]
                + ([j.partial_key] if j.partial and (j.matched or 0) >= j.pinned_from else []) for j in jobs]
        todo = [(j, ks[:window], len(ks) > window) for j, ks in zip(jobs, keys, strict=True) if ks]
        if not todo:
            return []
        t0 = time.monotonic()
        got = pin_all(self._links, [ks for _, ks, _ in todo])
        self._stages.add(pins=len(todo), pin_ms=(time.monotonic() - t0) * 1e3)
        again: list[Job] = []
        for (job, ks, cut), pins in zip(todo, got, strict=True):
            pins.cut = cut
            if (pins.refused or pins.short) and pins.count < len(ks) and job.wanted and self._room.waits(job):
                job.refusals += 1
                self._release(pins)
                again.append(job)
                continue
            job.degraded = job.degraded or any(r is None for r in pins.ranks)
            with self._lock:
                forgotten = job.forgotten
                if not forgotten:
                    job.pins = pins
            if forgotten:
                self._release(pins)
        return again
