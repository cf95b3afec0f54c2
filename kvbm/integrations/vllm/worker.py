"""The connector's worker side (one per TP rank): runs the loads and saves the scheduler side planned."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from kvbm.integrations.vllm.config import ConnectorConfig
from kvbm.integrations.vllm.geometry import K_SETTING, warn_once
from kvbm.integrations.vllm.groups import SINGLE, KVGroups
from kvbm.integrations.vllm.hooks import HookTimes
from kvbm.integrations.vllm.link import Links
from kvbm.integrations.vllm.loads import Loader
from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata, KvbmWorkerMetadata
from kvbm.integrations.vllm.paged import PagedCache
from kvbm.integrations.vllm.saves import Saver

log = logging.getLogger("kvbm.vllm")

# How often the engine's step asks whether the worker's daemon sessions lost their connection (a poll without
# waiting on the engine's thread, a task on the loader's and saver's).
LINK_CHECK_S = 1.0


class WorkerSide:
    """Copies between vLLM's paged KV cache and G2 slots; reports loads that failed and saves still running.

    Nothing here waits on the daemon on the engine's thread: a synchronous load (the CPU engine's default, whose
    forward needs the bytes) copies out of slots the scheduler pinned, saves run on their own thread, and a
    preemption only fences the copies out of the preempted request's blocks. (``async_save: false`` copies each
    step's saves out of vLLM's blocks before the step ends; the saver's thread writes and commits them.)"""

    def __init__(self, cfg: ConnectorConfig, links: Links, tp_rank: int, num_blocks: int | None,
                 saves: bool = True, groups: KVGroups = SINGLE, pin_rank: int | None = None) -> None:
        # tp_rank: this worker's rank in the engine, pp_rank * tp_size + tp_rank. saves: False on a rank
        # whose TP group stores one copy from another rank (MLA); it still loads (pin_rank: that rank's pins),
        # and reports its saves done so vLLM frees the blocks as on any rank.
        self.cfg, self.geometry, self.num_blocks, self.groups = cfg, links.geometry, num_blocks, groups
        self.epoch = links.epoch
        # Finished requests vLLM keeps the blocks of for this worker, until reported once (finished sending or
        # receiving): reporting one twice kills vLLM's scheduler, reporting it early frees blocks in use.
        self._finished: set[str] = set()
        pid = os.getpid()
        self._link = links.open(tp_rank, f"worker-r{tp_rank}-{pid}")
        self._cache = PagedCache({}, None)  # until register_kv_caches
        self.stats: dict[str, int] = {}
        self.hooks = HookTimes("worker", cfg.hook_warn_ms)
        # Async loads and saves each run on their own thread with their own daemon session (a client is
        # single-threaded).
        self.loader = Loader(self._link, links.open(tp_rank, f"loader-r{tp_rank}-{pid}"),
                             self._load_copy, self._nbytes_of, tp_rank if pin_rank is None else pin_rank)
        self._copied_step = -1  # the step whose pinned loads this worker copied, until vLLM collects it
        self._hook_thread = -1  # the engine's thread, as start_load_kv last saw it
        self._links_checked = 0.0  # when _drop_lost_links last ran
        self.saver = Saver(links.open(tp_rank, f"saver-r{tp_rank}-{pid}"),
                           lambda view, ids, stream: self._cache.copy(view, ids, False, stream is not None),
                           self._nbytes_of, saves, self.stats, int(cfg.stage_mib * 2**20))

    def _nbytes_of(self, ids: list[int], unused: int = 0) -> int:
        """The bytes of a kvbm block made of vLLM blocks ``ids`` (``k`` per group; fewer in a partial block), and
        ``unused`` more a load does not copy (vLLM's own hit holds them, or vLLM computes them)."""
        return self._cache.vblock_bytes * (len(ids) // max(1, self._cache.groups) + unused)

    def _load_copy(self, view: Any, ids: list[int], skip: int, unused: int) -> None:
        """A stored block of ``ids`` and ``unused`` more vLLM blocks into vLLM's blocks ``ids``, from its vLLM
        block ``skip`` on."""
        k = len(ids) // max(1, self._cache.groups)
        t0 = time.perf_counter()
        self._cache.copy(view, ids, True, slot_k=k + unused if unused else None, skip=skip)
        if threading.get_ident() == self._hook_thread:  # a synchronous load's copy, on the engine's step
            self.hooks.exclude((time.perf_counter() - t0) * 1e3)

    @property
    def _block_bytes(self) -> int:
        return self._cache.vblock_bytes * self.geometry.known_k

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._cache = PagedCache(kv_caches, self.num_blocks, self.groups)
        per_block, computed = self._cache.vblock_bytes, self.geometry.vblock_nbytes
        if per_block != computed:
            log.info("kvbm: engine block is %d B, layout arithmetic says %d B; storing the engine's bytes",
                     per_block, computed)
        client = self._link.get()  # at startup: a configuration error shows now, not at the first request
        self.saver.warm()
        if self.cfg.async_load:
            self.loader.warm()
        if client is not None and client.registered is not None and self._block_bytes > client.registered.slot_bytes:
            # k came from the layout arithmetic; the engine's real blocks are bigger and overflow a slot.
            slot = client.registered.slot_bytes
            warn_once(f"kvbm: this engine stores {per_block} B per vLLM block (the layout arithmetic says "
                      f"{computed} B), so {self.geometry.known_k} of them exceed the daemon's block_bytes of "
                      f"{slot} B: set kv_connector_extra_config.{K_SETTING} to at most "
                      f"{slot // per_block} or raise the daemon's block_bytes")

    def _same_k(self, meta: KvbmConnectorMetadata) -> bool:
        """Transfers planned with another k (a daemon restarted with other blocks in between) are refused."""
        if not self.geometry.k:
            self._link.get()  # this rank has not reached the daemon yet: resolve k now
        k = self.geometry.known_k
        if meta.k == k:
            return True
        if not k:
            return False  # daemon unreachable from this rank: loads are recomputed, saves dropped
        warn_once(f"kvbm: the scheduler plans {meta.k} vLLM blocks per kvbm block, this worker {k}; "
                  f"transfers skipped (vLLM recomputes); restart the engine")
        return False

    def _follow(self, meta: Any) -> None:
        """Take the scheduler's weights epoch before any transfer of this step (links re-register under it)."""
        if isinstance(meta, KvbmConnectorMetadata) and self.epoch is not None and self.epoch.follow(meta.weights):
            log.info("kvbm: new weights epoch %r: blocks stored before it are not loaded again", meta.weights)

    def handle_preemptions(self, meta: Any) -> None:
        """Before this step's forward (vLLM calls it first in every step, sync or async loads): no save reads
        blocks vLLM freed from now on: a finished request's (its unread saves and its last ones are staged), a
        preempted or aborted request's, and under a sliding window those the window dropped or a finished
        request's skipped blocks (any request's). Saves of them not copying yet are staged to host buffers (past the
        staging budget: waited for up to fence_wait_ms, then dropped)."""
        with self.hooks.time("handle_preemptions"):
            self._drop_lost_links()
            self._follow(meta)
            if not isinstance(meta, KvbmConnectorMetadata):
                return
            self.saver.new_step()
            finals = [tr for tr in meta.saves if tr.final]
            if meta.finished or finals:
                self.saver.hand_off(meta.finished, finals if finals and self._same_k(meta) else [])
            if self.groups.sliding:
                self.saver.fence(None, self.cfg.fence_wait_ms / 1000)
            elif meta.preempted or meta.released:
                self.saver.fence([*meta.preempted, *meta.released], self.cfg.fence_wait_ms / 1000)
            # Aborted requests vLLM freed at once: fenced above, never reported finished (vLLM forgot them).
            self.saver.forget(meta.released)

    def _drop_lost_links(self) -> None:
        """At most every LINK_CHECK_S: sessions whose daemon went away are let go with their mappings of its G2
        pool (a restarted daemon needs that memory back), the engine's own here, the loader's and saver's on
        their threads; else the engine's session, unused under async loads, kept the dead pool mapped for good."""
        now = time.monotonic()
        if now < self._links_checked + LINK_CHECK_S:
            return
        self._links_checked = now
        try:
            self._link.drop_if_lost(self.loader.dispose)  # the unmapping on the loader's thread, not this one
            self.loader.drop_if_lost()
            self.saver.drop_if_lost()
        except Exception as e:  # never the engine's death: the sessions are checked again in a second
            log.warning("kvbm: checking the daemon sessions failed: %r", e)

    def start_load_kv(self, meta: Any) -> None:
        self._hook_thread = threading.get_ident()
        with self.hooks.time("start_load_kv"):
            self._follow(meta)
            self.loader.failed_now = set()
            self.loader.failed_blocks_now = set()
            if not isinstance(meta, KvbmConnectorMetadata) or not meta.loads:
                return
            if any(tr.pins for tr in meta.loads):
                self._copied_step = meta.step  # said once the step is over, copied or not: the pins may go
            if not self._same_k(meta):
                # Every planned load is still reported, failed (vLLM recomputes it), or vLLM would keep an
                # async one in WAITING_FOR_REMOTE_KVS forever.
                self.loader.fail_all(meta.loads, bool(self.cfg.async_load))
                return
            self.loader.start(meta.loads, bool(self.cfg.async_load))

    def worker_meta(self) -> KvbmWorkerMetadata | None:
        """After a step: the step whose pinned loads were copied (the scheduler releases their pins)."""
        step, self._copied_step = self._copied_step, -1
        return KvbmWorkerMetadata({step}) if step >= 0 else None

    def wait_for_save(self, meta: Any) -> None:
        with self.hooks.time("wait_for_save"):
            if not isinstance(meta, KvbmConnectorMetadata):
                return
            self._follow(meta)
            saves = [tr for tr in meta.saves if not tr.final]  # the finished requests' were staged already
            if not saves:
                return
            trs = self._intact_saves(saves) if self._same_k(meta) else []
            if self.cfg.async_save:
                self.saver.submit(trs)
            else:
                self.hooks.exclude(self.saver.save_now(trs))  # copies of the step's own bytes, no round trip

    def _intact_saves(self, saves: list[BlockTransfer]) -> list[BlockTransfer]:
        """The saves to run after this step's sync loads (one dropped is not reported: a save holds no blocks).
        A block that did not load holds no KV,
        and whatever attended to it is not KV either: every save stops before the first such block, whichever
        request it is (vLLM caches a sync load's blocks at allocation, so a request admitted in the same step
        with the same prefix hit them). The scheduler plans them again once vLLM recomputed them."""
        failed = self.loader.failed_blocks_now
        if not failed:
            return saves
        trs: list[BlockTransfer] = []
        for tr in saves:
            n = next((i for i, ids in enumerate(tr.block_ids) if not failed.isdisjoint(ids)), len(tr.hashes))
            if n < len(tr.hashes):
                log.info("kvbm: request %s: %d block(s) not saved, they hold or follow KV that did not load",
                         tr.req_id, len(tr.hashes) - n)
            if n:
                trs.append(tr.head(n))
        return trs

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) for vLLM's transfer results."""
        with self.hooks.time("get_finished"):
            self._finished.update(r for r in finished_req_ids if self.saver.busy(r) or self.loader.busy(r))
            sending = self.saver.finished(finished_req_ids)
            recving, failed = self.loader.finished()
            # A finished request is reported once, when neither its saves nor its load use its blocks any more
            # (one preempted with saves, resumed through an async load and aborted while loading has both).
            recving = {r for r in recving if r not in self._finished or not self.saver.busy(r)}
            sending = {r for r in sending if not self.loader.busy(r) and r not in recving}
            self._finished -= sending | recving
            if self.groups.count == 1:
                failed = set()  # one group: block ids say exactly what to recompute (get_load_errors)
            return sending, recving, failed  # a failed async load is in both (vLLM's rule)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.loader.errors()
        # Block ids are unique only within a KV-cache group: with several, vLLM refuses them (and its engine
        # dies); the failed requests went in get_finished instead.
        return errors if self.groups.count == 1 else set()

    def shutdown(self) -> None:
        self.loader.shutdown()
        self.saver.shutdown()
        self._link.close()
