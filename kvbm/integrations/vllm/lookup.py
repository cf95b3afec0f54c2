"""Prefix lookups off vLLM's scheduler thread: the scheduler asks, a background thread talks to the daemon.

The scheduler calls :meth:`Lookups.ask` from ``get_num_new_matched_tokens``; the first call queues the
request's lookup and waits for its answer only while this step's wait budget lasts (a few milliseconds in
all, however many requests ask). An answer not there yet is ``None``: vLLM skips the request this step and
asks again the next. A lookup unanswered after ``give_up_s`` is a miss (the request is computed). One
thread owns every TP rank's link and sends a lookup to all ranks before awaiting any, so TP=8 costs one
round trip, not eight; lookups queued together are pipelined the same way. A link that fails answers its
lookups as misses at once and reconnects from this thread, never from the scheduler's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvbm import protocol as p
from kvbm.integrations.vllm.link import LINK_ERRORS, Link

log = logging.getLogger("kvbm.vllm")


@dataclass
class _Job:
    req_id: str
    hashes: list[bytes]
    asked: float = field(default_factory=time.monotonic)
    matched: int | None = None  # kvbm blocks every rank holds, once answered
    done: threading.Event = field(default_factory=threading.Event)


class Lookups:
    """The scheduler's prefix lookups, answered by one background thread (see the module docstring)."""

    def __init__(self, links: list[Link], wait_s: float, give_up_s: float, idle_s: float = 0.25) -> None:
        self._links = links
        self.wait_s, self.give_up_s, self.idle_s = wait_s, give_up_s, idle_s
        self._budget = wait_s  # this step's wait left (scheduler thread only)
        self._jobs: dict[str, _Job] = {}  # asked and not yet returned (scheduler thread only)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.gave_up = 0
        self._thread = threading.Thread(target=self._run, name="kvbm-lookup", daemon=True)
        self._thread.start()

    # Scheduler thread.
    def ask(self, req_id: str, hashes: list[bytes]) -> int | None:
        """kvbm blocks of ``hashes`` every rank holds, or None while that is not known yet."""
        job = self._jobs.get(req_id)
        if job is None or job.hashes != hashes:
            job = self._jobs[req_id] = _Job(req_id, hashes)
            self._queue.put(job)
        if not job.done.is_set() and self._budget > 0:
            t0 = time.monotonic()
            job.done.wait(self._budget)
            self._budget -= time.monotonic() - t0
        if job.done.is_set():
            del self._jobs[req_id]
            return job.matched
        if time.monotonic() - job.asked > self.give_up_s:
            del self._jobs[req_id]  # the thread's late answer goes nowhere
            self.gave_up += 1
            return 0
        return None

    def new_step(self) -> None:
        """The next scheduler step starts: its wait budget is whole again."""
        self._budget = self.wait_s

    def forget(self, req_id: str) -> None:
        self._jobs.pop(req_id, None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # The lookup thread.
    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                self._reconnect()
                continue
            if job is None:
                return
            batch = [job]
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._answer(batch)
                    return
                batch.append(more)
            self._answer(batch)

    def _reconnect(self) -> None:
        """Bring links that are down back up (each retries on its own backoff)."""
        for link in self._links:
            if link.client is None:
                link.get()

    def _answer(self, batch: list[_Job]) -> None:
        matched = [len(job.hashes) for job in batch]
        sent: list[tuple[Link, Any, list[Any]]] = []
        for link in self._links:  # every rank's lookups are sent before any reply is awaited
            client = link.get()
            if client is None:
                matched = [0] * len(batch)
                continue
            try:
                msgs = [client.begin(p.Lookup(namespace=client.namespace, hashes=job.hashes)) for job in batch]
            except LINK_ERRORS as e:
                link.error(e)
                matched = [0] * len(batch)
                continue
            sent.append((link, client, msgs))
        for link, client, msgs in sent:
            for i, msg in enumerate(msgs):
                try:
                    matched[i] = min(matched[i], client.finish(msg, p.LookupReply).matched)
                except LINK_ERRORS as e:
                    link.error(e)
                    matched[i] = 0
                    if link.client is None:  # the session is gone, and with it the replies still due
                        for j in range(i + 1, len(msgs)):
                            matched[j] = 0
                        break
        for job, m in zip(batch, matched, strict=True):
            job.matched = m
            job.done.set()
