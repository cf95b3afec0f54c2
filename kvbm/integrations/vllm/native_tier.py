"""kvbm as a secondary tier of vLLM's native offloading (``OffloadingConnector`` + ``TieringOffloadingSpec``).

vLLM loads it by ``module_path`` from its ``secondary_tiers`` list (the dict's other keys:
:class:`~kvbm.integrations.vllm.native_config.NativeTierConfig`)::

    {"type": "KvbmTier", "module_path": "kvbm.integrations.vllm.native_tier", "daemon": "ipc:///run/kvbm.sock"}

Every method runs on vLLM's scheduler thread and returns at once; the daemon is only ever talked to from
the tier's own threads, each with its own session (a client is single-threaded):

* lookups: vLLM's :class:`AsyncLookupManager` thread (one batch per request per step, as vLLM batches them;
  :mod:`~kvbm.integrations.vllm.native_lookup` answers it key by key); an answer not there after
  ``lookup_give_up_ms`` is a miss.
* stores (primary chunk -> daemon) and loads (daemon -> primary chunk): one thread each, so a load never
  waits behind stores. The bytes move once each way: the primary tier's chunk row is copied straight into
  the G2 slot the daemon reserved (shared memory), and out of the slot the daemon onboarded into.

A daemon that is gone or stalled never reaches vLLM as an exception: lookups miss, stores are dropped and
counted, loads are reported failed (vLLM recomputes), and each thread reconnects on kvbm's backoff.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvbm.blocks.layout import KVLayout
from kvbm.integrations.vllm.geometry import Geometry
from kvbm.integrations.vllm.link import LINK_ERRORS, Link
from kvbm.integrations.vllm.native_config import NativeTierConfig
from kvbm.integrations.vllm.native_events import RemovalWatch
from kvbm.integrations.vllm.native_keys import kvbm_hash, native_layout
from kvbm.integrations.vllm.native_lookup import Lookups
from kvbm.integrations.vllm.native_transfer import ChunkRows, Done

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvbm.vllm")

# Metric names (vLLM adds its engine labels); the tier label is the daemon tier for BLOCKS/BYTES.
STORES_DROPPED = "vllm:kvbm_tier_stores_dropped"
BLOCKS_DROPPED = "vllm:kvbm_tier_blocks_dropped"
LOOKUPS_GAVE_UP = "vllm:kvbm_tier_lookups_gave_up"
LOAD_BLOCKS_SHORT = "vllm:kvbm_tier_load_blocks_short"
DAEMON_UP = "vllm:kvbm_tier_daemon_up"
DAEMON_BLOCKS = "vllm:kvbm_tier_daemon_blocks"
DAEMON_BYTES = "vllm:kvbm_tier_daemon_bytes"
# Why a store was dropped: the daemon is down, the store queue is full, the daemon shed it or is full.
DROP_REASONS = ("down", "queue", "shed")


class _ChunkGeometry(Geometry):
    """One daemon block per primary chunk row, whatever the daemon's block size: a row bigger than the daemon's
    blocks is a config error. ``k`` is fixed at 1, never derived from the daemon's first block size: a daemon
    restarted with smaller blocks that still hold a row is fine (the namespace does not depend on it)."""

    def __init__(self, row_bytes: int, tokens: int) -> None:
        super().__init__(tokens, row_bytes, 1)

    def mismatch(self, slot_bytes: int) -> str:
        return (f"kvbm: vLLM's CPU-tier chunks are {self.vblock_nbytes} B, more than the daemon's block_bytes of "
                f"{slot_bytes} B: set the daemon's block_bytes to at least {self.vblock_nbytes} B, or lower "
                f"block_size in kv_connector_extra_config. The kvbm tier is off until then (stores dropped, "
                f"lookups miss).")


class KvbmTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over the kvbm daemon (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU  # the daemon's G2 host pool, in front of its disk and S3 tiers

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **extra: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.cfg = cfg = NativeTierConfig.parse(extra)
        self.locality = Locality(cfg.locality) if cfg.locality else Locality.LOCAL
        config = offloading_spec.config
        self.row_bytes = self.block_size_bytes
        # The primary tier's rows as numpy views (no copy): each copy below is one memcpy to or from G2.
        self.rows = ChunkRows(primary_kv_view, self.row_bytes)  # the copies between chunk rows and G2 slots
        self.layout: KVLayout = native_layout(config, self.row_bytes, cfg.model_name or "")
        self.endpoint, client_kw = cfg.client()
        geometry = _ChunkGeometry(self.row_bytes, self.layout.block_tokens)
        engine_id = str(config.engine_id or "vllm")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

        def link(role: str) -> Link:
            return Link(self.endpoint, geometry, lambda _k: self.layout, engine_id,
                        f"{engine_id}-native-{role}-{tag}", cfg.timeout_s, client_kw)

        self._lookup_link, self._store_link, self._load_link = link("lookup"), link("store"), link("load")
        self.events: list[OffloadingEvent] | None = None
        self._removals: RemovalWatch | None = None
        if cfg.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
                self._removals = RemovalWatch(cfg.events(), self.layout.namespace,
                                              curve_server_key=client_kw.get("curve_server_key") or "",
                                              curve_keypair=client_kw.get("curve_keypair"))
            else:
                log.warning("kvbm tier: enable_kv_events is set but vLLM's KV cache events are off; no events")
        # Scheduler thread only.
        self._asked: dict[OffloadKey, float] = {}  # key -> when its lookup first answered RETRY
        self._asked_by_req: dict[str, set[OffloadKey]] = {}
        self._stats = OffloadingConnectorStats()
        self._store_jobs = 0  # submitted and not yet reported
        # Scheduler -> threads, threads -> scheduler.
        self._stores: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._loads: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._outstanding = 0  # jobs queued or running, not yet in _done (guarded by _idle)
        self._idle = threading.Condition()
        self._cancel = threading.Event()  # drain_jobs: queued stores are reported failed, not run
        self._daemon_tiers: dict[str, tuple[int, int]] = {}  # daemon tier -> (blocks, bytes), from Stats
        self._stats_at = 0.0
        # At startup, before any step: a misconfiguration (a chunk bigger than the daemon's blocks) is logged
        # now, and the first lookup does not pay for a registration. From here on each link is used by its
        # own thread only (which also reconnects it).
        for lk in (self._store_link, self._lookup_link, self._load_link):
            if lk.get() is None:
                break
        self._lookups = Lookups(self._lookup_link, tier_type)
        self._threads = [threading.Thread(target=self._run, args=(self._stores, self._store_link, self.rows.store),
                                          name="kvbm-native-store", daemon=True),
                         threading.Thread(target=self._run, args=(self._loads, self._load_link, self.rows.load),
                                          name="kvbm-native-load", daemon=True)]
        for t in self._threads:
            t.start()

    # -- metrics -------------------------------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            STORES_DROPPED: OffloadingCounterMetadata(
                documentation="Store jobs the kvbm tier dropped, by reason (down, queue, shed).",
                labelnames=("reason",)),
            BLOCKS_DROPPED: OffloadingCounterMetadata(
                documentation="Chunks of the store jobs the kvbm tier dropped, by reason.", labelnames=("reason",)),
            LOOKUPS_GAVE_UP: OffloadingCounterMetadata(
                documentation="Chunk lookups the daemon did not answer within lookup_give_up_ms (misses)."),
            LOAD_BLOCKS_SHORT: OffloadingCounterMetadata(
                documentation="Chunks a kvbm load did not bring into the primary tier (vLLM recomputes them)."),
            DAEMON_UP: OffloadingGaugeMetadata(documentation="1 while the kvbm tier's store session is up."),
            DAEMON_BLOCKS: OffloadingGaugeMetadata(
                documentation="Blocks the kvbm daemon holds, by its tier (G2 host, G3 disk, G4 S3).",
                labelnames=("tier",)),
            DAEMON_BYTES: OffloadingGaugeMetadata(
                documentation="Bytes the kvbm daemon holds, by its tier.", labelnames=("tier",)),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self._stats
        stats.set_gauge(DAEMON_UP, 0 if self._store_link.client is None else 1)
        for tier, (blocks, nbytes) in dict(self._daemon_tiers).items():
            stats.set_gauge(DAEMON_BLOCKS, blocks, (tier,))
            stats.set_gauge(DAEMON_BYTES, nbytes, (tier,))
        self._stats = OffloadingConnectorStats()
        return stats

    # -- lookups (scheduler thread) --------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        got = self._lookups.lookup(key, req_context)
        if got is not None:
            self._asked.pop(key, None)
            return LookupResult.HIT if got else LookupResult.MISS
        now = time.monotonic()
        first = self._asked.setdefault(key, now)
        self._asked_by_req.setdefault(req_context.req_id, set()).add(key)
        if now - first <= self.cfg.lookup_give_up_ms / 1000:
            return LookupResult.RETRY
        if first > 0:  # counted once per key
            self._asked[key] = -1.0
            self._stats.increase_counter(LOOKUPS_GAVE_UP)
        return LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        for key in self._asked_by_req.pop(req_context.req_id, ()):
            self._asked.pop(key, None)

    # -- jobs (scheduler thread) ------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._store_jobs += 1
        link = self._store_link
        if link.client is None and time.monotonic() < link.down_until:
            self._drop(job_metadata, "down")  # no session and not due to retry: nothing would be stored
        elif self._stores.qsize() >= self.cfg.max_queued_stores:
            self._drop(job_metadata, "queue")
        else:
            self._queue(self._stores, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._queue(self._loads, job_metadata)

    def _queue(self, jobs: queue.SimpleQueue[TransferJob | None], job: TransferJob) -> None:
        with self._idle:
            self._outstanding += 1
        jobs.put(job)

    def _drop(self, job: TransferJob, why: str) -> None:
        self._done.put(Done(job.job_id, False, list(job.keys), False, dropped=why))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                d = self._done.get_nowait()
            except queue.Empty:
                return results
            if d.is_load:
                if not d.success:
                    got = set(d.loaded_keys)
                    self._lookups.mark_miss([k for k in d.keys if k not in got])  # or vLLM promotes them again
                    self._stats.increase_counter(LOAD_BLOCKS_SHORT, len(d.keys) - len(got))
                results.append(JobResult(d.job_id, d.success,
                                         tuple(d.loaded_keys) if not d.success and d.loaded_keys else None,
                                         d.seconds, d.nbytes or None))
                continue
            self._store_jobs -= 1
            if d.dropped:
                self._stats.increase_counter(STORES_DROPPED, 1, (d.dropped,))
                self._stats.increase_counter(BLOCKS_DROPPED, len(d.keys), (d.dropped,))
            elif d.success and self.events is not None:
                # removal_expected: a BlockRemoved follows when the daemon no longer holds it (RemovalWatch).
                self.events.append(OffloadingEvent(keys=d.keys, medium=Medium.CPU, removed=False,
                                                   locality=self.locality, ownership="kvbm",
                                                   removal_expected=self._removals is not None))
                if self._removals is not None:
                    self._removals.announce([(kvbm_hash(k), k) for k in d.keys])
            # A failed store's time is not a latency sample: vLLM's backpressure detector reads only successes.
            results.append(JobResult(d.job_id, d.success, None, d.seconds, d.nbytes or None))

    def has_pending_work(self) -> bool:
        return self._store_jobs > 0 or not self._done.empty()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        events, self.events = self.events, []
        gone = self._removals.take() if self._removals is not None else []
        if gone:
            events.append(OffloadingEvent(keys=gone, medium=Medium.CPU, removed=True, locality=self.locality,
                                          ownership="kvbm", removal_expected=True))
        return events

    def drain_jobs(self) -> None:
        """Wait for the jobs the threads are running; queued stores are reported failed without running."""
        self._cancel.set()
        try:
            with self._idle:
                self._idle.wait_for(lambda: self._outstanding == 0)
        finally:
            self._cancel.clear()

    def shutdown(self) -> None:
        self.drain_jobs()
        for q in (self._stores, self._loads):
            q.put(None)
        for t in self._threads:
            t.join()
        self._lookups.shutdown()
        for link in (self._lookup_link, self._store_link, self._load_link):
            link.close()
        if self._removals is not None:
            self._removals.close()
        self.rows.close()  # releases the export of vLLM's primary memoryview, so vLLM can unmap it

    # -- the tier's threads ------------------------------------------------------------------------------------
    def _run(self, jobs: queue.SimpleQueue[TransferJob | None], link: Link, work: Any) -> None:
        while True:
            try:
                job = jobs.get(timeout=0.25)
            except queue.Empty:
                if link.client is None:
                    link.get()  # reconnect in the background, on the link's own backoff
                elif link is self._store_link:
                    self._refresh_daemon_stats(link)
                continue
            if job is None:
                return
            try:
                if link is self._store_link and self._cancel.is_set():
                    done = Done(job.job_id, False, list(job.keys), False)
                else:
                    done = work(job, link)
            except Exception as e:  # a tier thread must never die: the job is reported failed
                log.warning("kvbm tier: job %s failed: %s", job.job_id, e)
                done = Done(job.job_id, False, list(job.keys), job.is_promotion)
            self._done.put(done)
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def _refresh_daemon_stats(self, link: Link) -> None:
        now = time.monotonic()
        if now - self._stats_at < self.cfg.stats_interval_s or link.client is None:
            return
        self._stats_at = now
        try:
            tiers = link.client.stats()["tiers"]
        except LINK_ERRORS as e:
            link.error(e)
            return
        self._daemon_tiers = {str(t.get("tier")): (int(t.get("blocks", 0) or 0), int(t.get("used_bytes", 0) or 0))
                              for t in tiers if t.get("tier")}

