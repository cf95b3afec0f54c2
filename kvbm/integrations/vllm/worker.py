"""The connector's worker side (one per TP rank): loads and saves between the paged KV cache and G2 slots."""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from kvbm import protocol as p
from kvbm.client import DaemonError, WorkerClient
from kvbm.integrations.vllm.config import ConnectorConfig
from kvbm.integrations.vllm.geometry import K_SETTING, warn_once
from kvbm.integrations.vllm.groups import NULL_BLOCK, SINGLE, KVGroups
from kvbm.integrations.vllm.link import LINK_ERRORS, Link, Links, is_load
from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata
from kvbm.integrations.vllm.paged import PagedCache

log = logging.getLogger("kvbm.vllm")
T = TypeVar("T")


def _done(result: T) -> Future[T]:
    """A finished future: a transfer that was never started, reported the way a started one is."""
    fut: Future[T] = Future()
    fut.set_result(result)
    return fut


class WorkerSide:
    """Runs the transfers the scheduler side planned; reports loads that failed and copies still running."""

    def __init__(self, cfg: ConnectorConfig, links: Links, tp_rank: int, num_blocks: int | None,
                 saves: bool = True, groups: KVGroups = SINGLE) -> None:
        # tp_rank: this worker's rank in the engine, pp_rank * tp_size + tp_rank. saves: False on a rank
        # whose TP group stores one copy from another rank (MLA); it still loads, and reports its saves
        # done so vLLM frees the blocks as on any rank.
        self.cfg, self.geometry, self.num_blocks, self.saves = cfg, links.geometry, num_blocks, saves
        self.groups = groups
        pid = os.getpid()
        self._link = links.open(tp_rank, f"worker-r{tp_rank}-{pid}")
        self._cache = PagedCache({}, None)  # until register_kv_caches
        self._load_errors: set[int] = set()
        # Async loads run on their own thread with their own daemon session (a client is single-threaded).
        self._load_link = links.open(tp_rank, f"loader-r{tp_rank}-{pid}")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvbm-load")
        self._loading: dict[str, Future[set[int]]] = {}
        # Async saves: copies into G2 run on their own thread (and CUDA stream) after each forward.
        self._save_link = links.open(tp_rank, f"saver-r{tp_rank}-{pid}")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvbm-save")
        self._saving: dict[str, list[Future[None]]] = {}
        self._finishing: set[str] = set()
        self._save_stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    @property
    def _block_bytes(self) -> int:
        return self._cache.vblock_bytes * self.geometry.known_k

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._cache = PagedCache(kv_caches, self.num_blocks, self.groups)
        per_block, computed = self._cache.vblock_bytes, self.geometry.vblock_nbytes
        if per_block != computed:
            log.info("kvbm: engine block is %d B, layout arithmetic says %d B; storing the engine's bytes",
                     per_block, computed)
        client = self._link.get()  # at startup: a configuration error shows now, not at the first request
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

    def start_load_kv(self, meta: Any) -> None:
        if self.groups.sliding:
            # A sliding-window group frees blocks mid-request, and this step may reuse them: the copies
            # out of them (async saves of earlier steps) finish before this step's forward writes.
            self.handle_preemptions()
        if not isinstance(meta, KvbmConnectorMetadata) or not meta.loads:
            return
        if not self._same_k(meta):
            # Every planned load is still reported: failed (vLLM recomputes it) and, when async, finished
            # receiving, or vLLM would keep the request in WAITING_FOR_REMOTE_KVS forever. vLLM's null block
            # (sliding-window blocks outside the window) is never reported.
            for tr in meta.loads:
                failed = {i for ids in tr.block_ids for i in ids if i != NULL_BLOCK}
                if self.cfg.async_load:
                    self._loading[tr.req_id] = _done(failed)
                else:
                    self._load_errors.update(failed)
            return
        if self.cfg.async_load:
            # The requests wait (WAITING_FOR_REMOTE_KVS) while other requests keep stepping; each is reported
            # as soon as its own blocks are in.
            futs: dict[str, Future[set[int]]] = {tr.req_id: Future() for tr in meta.loads}
            self._loading.update(futs)
            self._loader.submit(self._load_all, meta.loads, self._load_link, futs)
        else:
            self._load_errors.update(self._load_all(meta.loads, self._link))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        if self._saving:
            # Requests vLLM finished (and, by the scheduler's rule, did not free) that had saves.
            self._finishing.update(r for r in finished_req_ids if r in self._saving)
            for rid in list(self._finishing):
                if all(f.done() for f in self._saving[rid]):
                    self._finishing.discard(rid)
                    del self._saving[rid]
                    sending.add(rid)
        done = {rid for rid, fut in self._loading.items() if fut.done()}
        for rid in done:
            # Reported in this same pass: vLLM reads load errors right after get_finished.
            self._load_errors.update(self._loading.pop(rid).result())
        return sending or None, done or None

    def _load_all(self, trs: list[BlockTransfer], link: Link,
                  futs: dict[str, Future[set[int]]] | None = None) -> set[int]:
        """Copy each request's kvbm blocks into its vLLM blocks; returns the vLLM block ids that failed.

        Onboards are pipelined: a request's is sent before the replies to earlier ones are read, so the daemon
        brings a step's blocks up from disk or S3 together, but never more blocks at once than half the G2
        pool: each block an Onboard answers stays pinned in G2 until this worker releases it, and loads beyond
        the pool's room would stop short and be recomputed (seen: 4 queries x 31 blocks against 64 slots).
        Each request is copied in as its reply comes (and, with ``futs``, reported loaded at once)."""
        client = link.get()
        reg = client.registered if client is not None else None
        window = max(1, reg.num_slots // 2) if reg is not None else 1
        inflight: deque[tuple[BlockTransfer, p.Onboard | None]] = deque()
        releases: list[p.Release] = []
        failed: set[int] = set()
        settled: set[str] = set()

        def settle() -> None:
            tr, msg = inflight.popleft()
            loaded = 0
            if msg is not None and client is not None and link.client is client:
                try:
                    loaded = self._copy_in(client, tr, msg, releases)
                except LINK_ERRORS as e:
                    link.error(e)
                except Exception as e:  # a load must never take the engine down: the request is recomputed
                    log.warning("kvbm: load for request %s failed: %s", tr.req_id, e)
            bad = self._not_loaded(tr, loaded)
            failed.update(bad)
            settled.add(tr.req_id)
            if futs is not None:
                futs[tr.req_id].set_result(bad)

        held = 0
        try:
            for tr in trs:
                while inflight and held + len(tr.hashes) > window:
                    held -= len(inflight[0][0].hashes)
                    settle()
                    self._released(client, link, releases)  # unpinned in the daemon before the next Onboard
                msg = None
                if client is not None and link.client is client:
                    try:
                        msg = client.begin(p.Onboard(namespace=client.namespace, hashes=tr.hashes))
                    except LINK_ERRORS as e:
                        link.error(e)
                inflight.append((tr, msg))
                held += len(tr.hashes)
            while inflight:
                settle()
            self._released(client, link, releases)
        except Exception as e:  # never leave a request unreported: vLLM would wait for it forever
            log.warning("kvbm: loads of this step failed: %s", e)
            for tr in trs:
                if tr.req_id not in settled:
                    bad = self._not_loaded(tr, 0)
                    failed.update(bad)
                    if futs is not None and not futs[tr.req_id].done():
                        futs[tr.req_id].set_result(bad)
        return failed

    @staticmethod
    def _released(client: WorkerClient | None, link: Link, releases: list[p.Release]) -> None:
        """Read the replies to the Releases sent so far (each was sent as its request was copied in)."""
        for rel in releases:
            if client is None or link.client is not client:
                break
            try:
                client.finish(rel, p.Released)
            except LINK_ERRORS as e:
                link.error(e)
        releases.clear()

    def _copy_in(self, client: WorkerClient, tr: BlockTransfer, msg: p.Onboard, releases: list[p.Release]) -> int:
        """Copy the G2 slots the daemon answered ``msg`` with into the request's vLLM blocks; queue the
        Release of those slots (sent now, its reply read later). Returns the kvbm blocks copied."""
        rep = client.finish(msg, p.Onboarded)
        loaded = 0
        try:
            g2 = client.g2
            assert g2 is not None
            for i in range(rep.count):
                if rep.nbytes[i] != self._block_bytes:
                    break
                self._cache.copy(g2.slot_tensor(rep.slots[i], rep.nbytes[i]), tr.block_ids[i], True)
                loaded += 1
        finally:
            if rep.count:
                releases.append(client.begin(p.Release(namespace=client.namespace, hashes=tr.hashes[: rep.count])))
        return loaded

    def _not_loaded(self, tr: BlockTransfer, loaded: int) -> set[int]:
        """The vLLM block ids of ``tr`` from its first kvbm block that did not arrive on (vLLM recomputes them)."""
        failed: set[int] = set()
        if loaded < len(tr.hashes):
            for ids in tr.block_ids[loaded:]:
                failed.update(i for i in ids if i != NULL_BLOCK)  # the null block holds no request's KV
            log.info("kvbm: request %s loaded %d/%d blocks; the rest is recomputed", tr.req_id, loaded,
                     len(tr.hashes))
        return failed

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, KvbmConnectorMetadata) or not meta.saves:
            return
        if not self._same_k(meta):
            if self.cfg.async_save:
                # Dropped, but reported as finished sending: the scheduler keeps these requests' blocks
                # until then, so an unreported save would hold them forever.
                for tr in meta.saves:
                    self._saving.setdefault(tr.req_id, []).append(_done(None))
            return
        if self.cfg.async_save:
            # The saver copies after everything queued so far (this step's forward) has run.
            ready = None
            if self._save_stream is not None:
                ready = torch.cuda.Event()
                ready.record()
            for tr in meta.saves:
                self._saving.setdefault(tr.req_id, []).append(self._saver.submit(self._save_async, tr, ready))
            return
        client = self._link.get()
        if client is None:
            return
        for tr in meta.saves:
            try:
                self._save_one(client, tr)
            except LINK_ERRORS as e:
                self._link.error(e)
                if self._link.client is None:
                    return

    def _save_async(self, tr: BlockTransfer, ready: Any) -> None:
        client = self._save_link.get()
        if client is None:
            return
        try:
            if self._save_stream is not None:
                with torch.cuda.stream(self._save_stream):
                    self._save_stream.wait_event(ready)
                    self._save_one(client, tr, self._save_stream)
            else:
                self._save_one(client, tr)
        except LINK_ERRORS as e:
            self._save_link.error(e)
        except Exception as e:  # a saver thread must never take the engine down
            log.warning("kvbm: save for request %s failed: %s", tr.req_id, e)

    def handle_preemptions(self) -> None:
        # Preempted requests' blocks are about to be reused: finish every copy out of them first.
        for futs in list(self._saving.values()):
            for f in futs:
                f.result()

    def _save_one(self, client: WorkerClient, tr: BlockTransfer, stream: Any = None) -> None:
        if not self.saves:
            return
        ns = client.namespace
        try:
            slots = client.request(p.PrepareStore(namespace=ns, hashes=tr.hashes, nbytes=self._block_bytes),
                                   p.Slots).slots
        except DaemonError as e:
            if is_load(e):
                return  # the daemon is saturated or full: skip this save, the engine keeps going
            raise
        g2 = client.g2
        assert g2 is not None
        ok = True
        try:
            for slot, vblocks in zip(slots, tr.block_ids, strict=True):
                if slot is not None:
                    self._cache.copy(g2.slot_tensor(slot, self._block_bytes), vblocks, False, stream is not None)
            if stream is not None:
                stream.synchronize()  # the bytes are in G2 before the daemon is told to commit them
        except BaseException:
            ok = False
            raise
        finally:
            client.request(p.CommitStore(namespace=ns, hashes=tr.hashes, ok=ok), p.Ack)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for pool in (self._loader, self._saver):
            pool.shutdown(wait=True)
        for link in (self._link, self._load_link, self._save_link):
            link.close()
