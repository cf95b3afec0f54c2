"""The worker's saves: copies of finished KV blocks into G2 on a thread of their own, fenced on preemption.

A save is one request's kvbm blocks: PrepareStore (a daemon round trip), the copy out of vLLM's blocks into
the reserved G2 slots, CommitStore. Only the copy reads vLLM's blocks, so only the copy has to be over before
vLLM reuses them (a preempted request's blocks, a sliding-window group's freed ones): :meth:`Saver.fence`
stages a save whose copy has not started (its blocks copied to host buffers: the daemon's round trip is never
waited for on the engine's thread) and waits for one that is copying (memory speed, bounded). A copy the fence
gave up on is committed as failed, never as the request's KV. A request vLLM freed at its finish hands its
unread saves to :mod:`~kvbm.integrations.vllm.staging` (:meth:`Saver.hand_off`) the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvbm.client.lease import pin_window, reserving
from kvbm.integrations.vllm.link import LINK_ERRORS, Link, is_load
from kvbm.integrations.vllm.metadata import BlockTransfer
from kvbm.integrations.vllm.staging import Staging, write

log = logging.getLogger("kvbm.vllm")

QUEUED, COPYING, CANCELLED = range(3)
# A copy between host buffers (or a span of them off a GPU's side stream) is done in milliseconds; one still
# running after this is dropped (committed as failed, never as KV) rather than the engine's step held longer.
FENCE_WAIT_S = 0.1
LOAD_RETRIES = 2  # a reservation refused as load is asked again this many times


class SaveJob:
    """One request's save and the state the fence and the saver thread agree on."""

    def __init__(self, tr: BlockTransfer, gen: int = -1) -> None:
        self.tr = tr
        self.gen = gen  # the weights epoch it was planned in: stored only under that epoch
        self.state = QUEUED
        self.poisoned = False  # the fence stopped waiting for the copy: its bytes may be the next user's
        self.lock = threading.Lock()
        self.copied = threading.Event()
        # Its blocks' bytes, copied out of vLLM's blocks when vLLM freed them (a finished request's), and what to
        # wait on before reading them: the save reads these instead of vLLM's blocks.
        self.staged: list[torch.Tensor] | None = None
        self.staged_ready: Any = None
        self.reads_done = threading.Event()  # it reads no vLLM block any more (its last copy is over, or it ended)
        self.future: Future[None] = Future()

    def start_copy(self) -> bool:
        """The saver is about to read vLLM's blocks: False when the fence cancelled the job first."""
        with self.lock:
            if self.state == CANCELLED:
                return False
            self.state = COPYING
            self.copied.clear()
            return True

    def end_copy(self) -> bool:
        """A copy is over (a save in several reservations copies several times); whether its bytes can be
        committed."""
        with self.lock:
            self.state = QUEUED
            self.copied.set()
            return not self.poisoned

    def fence(self, wait_s: float) -> bool:
        """Make sure nothing reads this job's vLLM blocks from now on; True if it was cancelled."""
        with self.lock:
            if self.state == QUEUED:
                self.state = CANCELLED
                return True
            if self.state != COPYING:
                return False
        if not self.copied.wait(wait_s):
            with self.lock:
                if self.state == COPYING:
                    self.poisoned = True
                    log.warning("kvbm: the save of request %s was still copying after %.1fs; it is dropped",
                                self.tr.req_id, wait_s)
        return False


class Saver:
    """Runs saves on one thread with its own daemon session; reports which finished requests' saves are done."""

    def __init__(self, link: Link, copy: Callable[[torch.Tensor, list[int], Any], None],
                 nbytes_of: Callable[[list[int]], int], enabled: bool, stats: dict[str, int],
                 stage_bytes: int = 0) -> None:
        # copy(slot view, vLLM block ids, stream): the paged cache's copy out of vLLM's blocks; nbytes_of(ids):
        # the bytes of a kvbm block of those vLLM blocks (a partial block has fewer than k).
        self._link, self._copy, self._nbytes_of, self.enabled, self.stats = link, copy, nbytes_of, enabled, stats
        self.staging = Staging(copy, nbytes_of, stage_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvbm-save")
        self._jobs: dict[str, list[SaveJob]] = {}
        self._unreported: list[SaveJob] = []  # saves of requests vLLM forgot (freed without waiting for them)
        self._finishing: set[str] = set()
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # the saves' own CUDA stream

    def warm(self) -> None:
        """Open the saver's session now, on its thread (a link is used from one thread), not at the first save:
        the first request's saves then do not wait for the session's set-up round trips."""
        if self.enabled:
            self._pool.submit(self._link.get)

    def drop_if_lost(self) -> None:
        """Let the saver's session go, on its thread, if its daemon's connection dropped (see
        :meth:`Link.drop_if_lost`)."""
        self._pool.submit(self._link.drop_if_lost)

    def pending(self) -> bool:
        self._unreported = [j for j in self._unreported if not j.future.done()]
        return bool(self._unreported) or any(not j.future.done() for jobs in self._jobs.values() for j in jobs)

    def busy(self, req_id: str) -> bool:
        """Whether ``req_id`` has saves not reported finished yet."""
        return req_id in self._jobs

    def _gen(self) -> int:
        epoch = self._link.epoch
        return epoch.gen if epoch is not None else -1

    def submit(self, trs: Iterable[BlockTransfer]) -> None:
        """Queue saves after everything queued on the device so far (this step's forward) has run."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        gen = self._gen()
        for tr in trs:
            job = SaveJob(tr, gen)
            self._jobs.setdefault(tr.req_id, []).append(job)
            self._pool.submit(self._run, job, ready)

    def save_now(self, trs: Iterable[BlockTransfer]) -> float:
        """``async_save: false``: each save's blocks copied out of vLLM's blocks now (staged, within the step's
        staging budget), written to G2 and committed on the saver's thread: the engine's step never waits on the
        daemon. A save past the budget goes as an async save does (read on the saver's thread, fenced). The ms
        spent copying."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        gen = self._gen()
        rest = [tr for tr in trs if not self._save_staged(SaveJob(tr, gen), drop=False)]
        ms = (time.perf_counter() - t0) * 1e3
        self.submit(rest)
        return ms

    def new_step(self) -> None:
        """A step begins (before its forward): its staging budget is whole again."""
        self.staging.new_step()

    def fence(self, req_ids: Iterable[str] | None = None, wait_s: float = 0.0) -> None:
        """Before vLLM reuses blocks: no save reads those of ``req_ids`` (of every request if None) from now on.
        A save that has not read them yet is staged (its blocks copied to host buffers now, as a finished
        request's), so the engine never waits for the daemon's round trips; one past the staging budget is waited
        for up to ``wait_s`` in all, then dropped. A copy running now is waited for (memory speed, bounded)."""
        started = time.monotonic()
        deadline = started + wait_s
        ids = list(self._jobs) if req_ids is None else [r for r in req_ids if r in self._jobs]
        for rid in ids:
            for job in self._jobs[rid]:
                if job.future.done() or self._stage(job, drop=False):
                    continue
                if job.state != QUEUED or job.poisoned:
                    continue  # cancelled already, or its copy overran and is committed as failed
                left = deadline - time.monotonic()  # past the staging budget: its reads, not its commit
                if left > 0 and job.reads_done.wait(left):
                    continue
                if job.fence(FENCE_WAIT_S):
                    self.stats["saves_cancelled"] = self.stats.get("saves_cancelled", 0) + len(job.tr.hashes)
        if ids and time.monotonic() - started > 0.005:
            log.debug("kvbm: fencing saves of %d requests took %.1f ms", len(ids), (time.monotonic() - started) * 1e3)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM freed without waiting for their saves (aborted and fenced, or finished and handed off):
        never reported."""
        for rid in req_ids:
            self._unreported.extend(self._jobs.pop(rid, ()))
            self._finishing.discard(rid)

    def hand_off(self, req_ids: Iterable[str], finals: list[BlockTransfer]) -> None:
        """Before the forward: requests vLLM freed at their finish. Their saves that have not read their blocks
        yet, and ``finals`` (their last blocks, planned at the finish), are staged (copied to host buffers now)
        and saved from there; one copying is waited for (memory speed, bounded). Past the staging budget a
        save is dropped and counted."""
        for rid in req_ids:
            for job in self._jobs.get(rid, ()):
                self._stage(job)
        self.forget(req_ids)
        gen = self._gen()
        for tr in finals:
            if self.enabled:
                self._save_staged(SaveJob(tr, gen))

    def _save_staged(self, job: SaveJob, drop: bool = True) -> bool:
        """Stage ``job`` (copy its blocks to host buffers now) and save it from there on the saver's thread; it
        reads no vLLM block after this, so vLLM never waits for it. False past the staging budget (dropped and
        counted with ``drop``)."""
        if not self._stage(job, drop):
            return False
        self._unreported.append(job)
        self._pool.submit(self._run, job, None)
        return True

    def _stage(self, job: SaveJob, drop: bool = True) -> bool:
        """Make ``job`` read host buffers, not vLLM's blocks; whether it will still save. Past the staging budget
        it is dropped (``drop``) or left queued (False is returned: the caller decides)."""
        while not job.reads_done.is_set():
            with job.lock:
                if job.state == CANCELLED or job.staged is not None:
                    return job.state != CANCELLED
                if job.state == QUEUED:  # not reading now: staged under the lock, the saver waits for it
                    if not self.staging.fits(job.tr.block_ids):
                        if not drop:
                            return False
                        job.state = CANCELLED
                        self.stats["saves_unstaged"] = self.stats.get("saves_unstaged", 0) + len(job.tr.hashes)
                        return False
                    job.staged, job.staged_ready = self.staging.take(job.tr.block_ids)
                    return True
            # Copying one span now (memory speed): then it reads no more, or is queued again for the next span
            if not job.copied.wait(FENCE_WAIT_S):
                job.fence(0)
                return False
        return True

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished (and kept the blocks of, for their saves) whose saves are all over."""
        self._finishing.update(r for r in finished_req_ids if r in self._jobs)
        done: set[str] = set()
        for rid in list(self._finishing):
            if all(j.future.done() for j in self._jobs[rid]):
                self._finishing.discard(rid)
                del self._jobs[rid]
                done.add(rid)
        return done

    def _run(self, job: SaveJob, ready: Any) -> None:
        try:
            if job.state == CANCELLED or not self.enabled:
                return
            client = self._link.get()
            if client is None:
                return
            if self._link.epoch is not None and self._link.gen != job.gen:
                # Planned before a weight reset: the old weights' KV is never stored under the new epoch.
                self.stats["saves_dropped_epoch"] = self.stats.get("saves_dropped_epoch", 0) + len(job.tr.hashes)
                return
            try:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        if ready is not None:  # a staged save reads its buffers, not this step's blocks
                            self.stream.wait_event(ready)
                        self.save(client, job)
                else:
                    self.save(client, job)
            except LINK_ERRORS as e:
                self._link.error(e)
        except Exception as e:  # a saver thread must never take the engine down
            log.warning("kvbm: save for request %s failed: %s", job.tr.req_id, e)
        finally:
            job.reads_done.set()
            if job.staged is not None:
                self.staging.give_back(job.staged)
            job.future.set_result(None)

    def save(self, client: Any, job: SaveJob) -> None:
        """PrepareStore -> copy (unless fenced first) -> CommitStore, in reservations no bigger than this
        session's slot budget (a long prompt's save would otherwise be refused whole). A reservation the daemon
        refuses as load (``full``, ``shed``, ``busy``) is asked again twice, 20 ms and 80 ms later, on this
        thread (a burst of saves passes), then skipped and counted."""
        tr = job.tr
        nbytes = self._nbytes_of(tr.block_ids[0]) if tr.block_ids else 0  # a transfer's blocks are one size
        step = pin_window(client.registered)
        for a in range(0, len(tr.hashes), step):
            span = range(a, min(a + step, len(tr.hashes)))
            for attempt in range(LOAD_RETRIES + 1):
                try:
                    if not self._save_span(client, job, span, nbytes):
                        return
                    break
                except Exception as e:
                    if not is_load(e):
                        raise
                    if attempt == LOAD_RETRIES or job.state == CANCELLED:
                        # The daemon stays saturated or full: the rest is skipped, the engine keeps going.
                        self.stats["saves_skipped"] = self.stats.get("saves_skipped", 0) + len(tr.hashes) - a
                        return
                    time.sleep(0.02 * 4**attempt)

    def _save_span(self, client: Any, job: SaveJob, span: range, nbytes: int) -> bool:
        """Blocks ``span`` of the job; whether the rest may follow."""
        tr = job.tr
        with reserving(client, tr.hashes[span.start : span.stop], nbytes, partial=tr.partial,
                       covers=tr.covers[span.start : span.stop]) as res:
            if not any(s is not None for s in res.slots):
                return True  # every block is stored already: nothing to read
            if not job.start_copy():
                res.ok = False  # preempted while the daemon answered: its blocks are someone else's now
                return False
            try:
                if job.staged_ready is not None:
                    job.staged_ready.synchronize()
                for i, vblocks in enumerate(tr.block_ids[span.start : span.stop]):
                    view = res.view(i)
                    if view is None:
                        continue
                    if job.staged is not None:
                        write(view, job.staged[span.start + i])
                    else:
                        self._copy(view, vblocks, self.stream)
                if self.stream is not None:
                    self.stream.synchronize()  # the bytes are in G2 before the daemon is told to commit
            finally:
                res.ok = job.end_copy()
                if span.stop == len(tr.hashes):
                    job.reads_done.set()  # what is left is the CommitStore: the fence need not wait for it
            self.stats["saved"] = self.stats.get("saved", 0) + len(span)
            return res.ok

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._link.close()
