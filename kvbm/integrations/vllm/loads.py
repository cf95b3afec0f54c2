"""The worker's loads: kvbm blocks copied out of G2 into the vLLM blocks the scheduler allocated for them.

A synchronous load's blocks come pinned (:mod:`~kvbm.integrations.vllm.pins`): the scheduler's lookup thread
pinned them, the load names their G2 slots, and the engine's step only copies, out of this process's mapping of
the pool of that generation (a pool it has not mapped yet, after a daemon restart, is mapped on the loader's
thread, and the load meanwhile is recomputed). Otherwise (async loads) a step's Onboards are pipelined (one is
sent before the replies to earlier ones are read, so the daemon brings the step's blocks up from disk or S3
together) within the session's pin budget, which the daemon states:
every block an Onboard answers stays pinned in G2 until it is released, and loads beyond the budget would stop
short. Each request is reported as its blocks arrive. A load that comes up short is reported two ways, as vLLM
asks for: the vLLM block ids that did not arrive (vLLM recomputes from the first), and the request itself
(``failed_recving``), which is the only form vLLM accepts for a model with several KV-cache groups.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvbm.client.lease import Onboarding, pin_window
from kvbm.integrations.vllm.groups import NULL_BLOCK
from kvbm.integrations.vllm.link import LINK_ERRORS, Link
from kvbm.integrations.vllm.metadata import BlockTransfer
from kvbm.integrations.vllm.pool_maps import PoolMaps
from kvbm.integrations.vllm.stages import stages_of

log = logging.getLogger("kvbm.vllm")

def failed_ids(tr: BlockTransfer, loaded: int) -> set[int]:
    """The vLLM block ids of ``tr`` from its first kvbm block that did not arrive on (vLLM recomputes them)."""
    failed: set[int] = set()
    if loaded < len(tr.hashes):
        for ids in tr.block_ids[loaded:]:
            failed.update(i for i in ids if i != NULL_BLOCK)  # the null block holds no request's KV
        log.info("kvbm: request %s loaded %d/%d blocks; the rest is recomputed", tr.req_id, loaded, len(tr.hashes))
    return failed


def done_future(result: set[int]) -> Future[set[int]]:
    fut: Future[set[int]] = Future()
    fut.set_result(result)
    return fut


class Loader:
    """Runs a step's loads, on the engine's thread (sync) or a thread of their own (async)."""

    def __init__(self, link: Link, async_link: Link, copy: Callable[[torch.Tensor, list[int], int, int], None],
                 nbytes_of: Callable[[list[int], int], int], pin_rank: int = 0) -> None:
        # copy(slot view, vLLM block ids, skip, unused): the paged cache's copy into vLLM's blocks, from the stored
        # block's vLLM block ``skip`` on, of a block holding ``unused`` vLLM blocks more than ``ids``.
        # nbytes_of(ids, unused): the bytes of a stored kvbm block of those vLLM blocks and ``unused`` more (a
        # partial block has fewer than k).
        self._link, self._async_link, self._copy, self._nbytes_of = link, async_link, copy, nbytes_of
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvbm-load")
        self._stages = stages_of("worker")
        self._loading: dict[str, Future[set[int]]] = {}
        self._errors: set[int] = set()  # vLLM block ids that did not load, until vLLM reads them
        self._failed: set[str] = set()  # requests whose load came up short, until vLLM reads them
        self.failed_now: set[str] = set()  # requests whose sync load of the current step came up short
        self.failed_blocks_now: set[int] = set()  # and the vLLM block ids that did not load
        self._pin_rank = pin_rank  # whose pins this worker copies (its own; under MLA its TP group's storing rank)
        self.pools = PoolMaps(link, async_link, self._pool.submit)  # what synchronous loads copy out of

    def warm(self) -> None:
        """Open the async link's session now, on the loader's thread, not at the first load (its set-up round
        trips would come before the first hit's blocks)."""
        self._pool.submit(self._async_link.get)

    def dispose(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loader's thread: an unmapping the engine's thread hands over."""
        self._pool.submit(fn, *args)

    def drop_if_lost(self) -> None:
        """(The engine's thread.) Release the pools whose daemon the loader's thread saw go, and have that thread
        check its session again (see :meth:`Link.drop_if_lost`)."""
        self.pools.release_gone()
        self._pool.submit(self.pools.drop_session_if_lost)

    def fail_all(self, trs: list[BlockTransfer], asynchronous: bool) -> None:
        """Loads never started, reported as failed (vLLM recomputes them, and never waits for them)."""
        for tr in trs:
            bad = failed_ids(tr, 0)
            self._failed.add(tr.req_id)
            if asynchronous:
                self._loading[tr.req_id] = done_future(bad)
            else:
                self._errors.update(bad)
                self.failed_now.add(tr.req_id)
                self.failed_blocks_now.update(bad)

    def start(self, trs: list[BlockTransfer], asynchronous: bool) -> None:
        pinned = [tr for tr in trs if tr.pins] if not asynchronous else []
        if pinned:
            trs = [tr for tr in trs if not tr.pins]
            for tr in pinned:
                n = self._copy_pinned(tr)
                mine = tr.pins.get(self._pin_rank)
                if tr.unpinned_rest and mine is not None and n == len(mine[1]) and n < len(tr.hashes):
                    # A hit longer than the pin window: its rest is brought up and copied here, waiting on the
                    # daemon (the one case a sync load does; a G2 or a slot budget smaller than one prompt's hit).
                    self._sync_result(tr.req_id, self._load_all([tr.after(n)], self._link)[tr.req_id])
                else:
                    self._sync_result(tr.req_id, failed_ids(tr, n))
            if not trs:
                return
        if asynchronous:
            # The requests wait (WAITING_FOR_REMOTE_KVS) while others keep stepping; each is reported as soon
            # as its own blocks are in.
            futs: dict[str, Future[set[int]]] = {tr.req_id: Future() for tr in trs}
            self._loading.update(futs)
            self._pool.submit(self._load_all, trs, self._async_link, futs)
        else:
            for rid, bad in self._load_all(trs, self._link).items():
                self._sync_result(rid, bad)

    def _sync_result(self, rid: str, bad: set[int]) -> None:
        if bad:
            self._errors.update(bad)
            self._failed.add(rid)
            self.failed_now.add(rid)
            self.failed_blocks_now.update(bad)

    def _copy_pinned(self, tr: BlockTransfer) -> int:
        """Copy a load out of the slots its pins name; the leading blocks copied."""
        pins = tr.pins.get(self._pin_rank)
        if pins is None:
            return 0
        generation, slots, nbytes = pins
        g2 = self.pools.pool_of(generation)
        if g2 is None:
            return 0
        loaded = 0
        try:
            loaded = self._copy_in(tr, 0, [g2.slot_tensor(s, n) for s, n in zip(slots, nbytes, strict=True)], nbytes)
        except Exception as e:  # a load must never take the engine down: the request is recomputed
            log.warning("kvbm: load for request %s failed: %s", tr.req_id, e)
        self._stages.add(pinned_blocks=loaded)
        return loaded

    def _copy_in(self, tr: BlockTransfer, a: int, views: list[torch.Tensor], nbytes: list[int]) -> int:
        """Copy stored blocks ``a``, ``a + 1``, ... of ``tr`` in from ``views`` (of ``nbytes`` each) as far as each
        is the size its vLLM blocks take; the blocks copied."""
        n = 0
        for i in range(min(len(views), len(tr.hashes) - a)):
            ids, unused = tr.block_ids[a + i], tr.unused(a + i)
            if nbytes[i] != self._nbytes_of(ids, unused):
                break
            self._copy(views[i], ids, tr.first_unused(a + i), unused)
            n += 1
        return n

    def busy(self, req_id: str) -> bool:
        """Whether an async load of ``req_id`` is still to be reported (it may be writing its blocks)."""
        return req_id in self._loading

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose async load is over, requests whose load, sync or async, came up short)."""
        done = {rid for rid, fut in self._loading.items() if fut.done()}
        for rid in done:
            bad = self._loading.pop(rid).result()
            if bad:
                self._errors.update(bad)  # read by vLLM right after, in this same pass
                self._failed.add(rid)
        failed, self._failed = self._failed, set()
        return done, failed

    def errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _load_all(self, trs: list[BlockTransfer], link: Link,
                  futs: dict[str, Future[set[int]]] | None = None) -> dict[str, set[int]]:
        """Copy each request's blocks in; the vLLM block ids that failed, per request."""
        failed: dict[str, set[int]] = {}

        def report(tr: BlockTransfer, loaded: int) -> None:
            failed[tr.req_id] = bad = failed_ids(tr, loaded)
            if futs is not None and not futs[tr.req_id].done():
                futs[tr.req_id].set_result(bad)

        try:
            self._pipeline(trs, link, report)
        except Exception as e:  # never leave a request unreported: vLLM would wait for it forever
            log.warning("kvbm: loads of this step failed: %s", e)
        for tr in trs:
            if tr.req_id not in failed:
                report(tr, 0)
        return failed

    def _pipeline(self, trs: list[BlockTransfer], link: Link, report: Callable[[BlockTransfer, int], None]) -> None:
        client = link.get()
        window = pin_window(client.registered if client is not None else None)
        # Each request's blocks in pieces of at most the pin window (a long prompt's load is split as its save
        # is, rather than refused whole); a request is reported when its last piece settled.
        pieces = [(tr, a, min(a + window, len(tr.hashes))) for tr in trs for a in range(0, len(tr.hashes), window)]
        loaded: dict[str, int] = {tr.req_id: 0 for tr in trs}
        inflight: deque[tuple[BlockTransfer, int, int, Onboarding | None]] = deque()
        settled: list[Onboarding] = []
        held = 0

        def live() -> bool:
            return client is not None and link.client is client

        def settle() -> None:
            tr, a, b, job = inflight.popleft()
            got_all = loaded[tr.req_id] == a  # every earlier piece came in whole: this one continues the run
            if job is not None and live():
                try:
                    t0 = time.perf_counter()
                    with job.loaded() as got:
                        self._stages.add(onboards=1, onboard_ms=(time.perf_counter() - t0) * 1e3,
                                         onboard_blocks=got.count)
                        if got_all:
                            loaded[tr.req_id] += self._copy_in(tr, a, [got.view(i) for i in range(got.count)],
                                                               got.nbytes)
                    settled.append(job)
                except LINK_ERRORS as e:
                    link.error(e)
                except Exception as e:  # a load must never take the engine down: the request is recomputed
                    log.warning("kvbm: load for request %s failed: %s", tr.req_id, e)
            if b == len(tr.hashes):
                report(tr, loaded[tr.req_id])

        def released() -> None:
            for job in settled:
                if not live():
                    break
                try:
                    job.released()
                except LINK_ERRORS as e:
                    link.error(e)
            settled.clear()

        for tr, a, b in pieces:
            while inflight and held + (b - a) > window:
                held -= inflight[0][2] - inflight[0][1]
                settle()
                released()  # unpinned in the daemon before the next Onboard
            job = None
            if live() and loaded[tr.req_id] >= 0:
                try:
                    job = Onboarding(client, tr.hashes[a:b])
                except LINK_ERRORS as e:
                    link.error(e)
            inflight.append((tr, a, b, job))
            held += b - a
        while inflight:
            settle()
        released()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._async_link.close()
