"""The connector's scheduler side (EngineCore process): prefix lookups, what to load and save, health."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvbm.blocks.layout import KVLayout
from kvbm.integrations.vllm.config import ConnectorConfig
from kvbm.integrations.vllm.epoch import WeightsEpoch
from kvbm.integrations.vllm.geometry import K_SETTING
from kvbm.integrations.vllm.groups import SINGLE, KVGroups
from kvbm.integrations.vllm.hooks import HookTimes
from kvbm.integrations.vllm.inflight import SavesInFlight
from kvbm.integrations.vllm.link import Link, Links
from kvbm.integrations.vllm.lookup import Hit, Lookups
from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata, KvbmWorkerMetadata
from kvbm.integrations.vllm.pins import PinBook
from kvbm.integrations.vllm.save_plan import ReqState, SavePlanner, replan_failed_loads

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class SchedulerSide:
    """Asks the daemon for each new request's stored prefix, plans loads and saves, reports health."""

    def __init__(self, cfg: ConnectorConfig, links: Links, ranks: list[int], groups: KVGroups = SINGLE) -> None:
        self.cfg, self.endpoint, self.geometry, self.groups = cfg, links.endpoint, links.geometry, groups
        self.epoch = links.epoch or WeightsEpoch(cfg.weights_version)
        self._step = 0  # build_connector_meta calls so far
        # One scheduler serves every worker (TP rank x PP stage): a prefix counts only if each stored it.
        self._links = [links.open(r, f"scheduler-r{r}", map_g2=False) for r in ranks]
        for link in self._links:
            link.unregister = False  # its pins are read by the workers: a dropped session must not free them
        self._ranks = list(ranks)
        self._reqs: dict[str, ReqState] = {}
        self.hooks = HookTimes("scheduler", cfg.hook_warn_ms)
        self._stats = {"lookups": 0, "hit_blocks": 0, "loads": 0, "saves": 0, "preempted": 0}
        # Requests whose blocks the worker may still be writing (async loads): vLLM must not free those blocks at
        # request_finished; the worker reports them as finished receiving instead. Both sides derive this from the
        # same metadata, so they agree. Saves never hold blocks: the worker stages a finished request's unread
        # saves before vLLM reuses them (kvbm.integrations.vllm.staging).
        self._load_pending: set[str] = set()
        # Requests a load failed for: recomputed from then on (offering the prefix again would make a stuck
        # loader fail it again, in a loop); forgotten at request_finished.
        self._load_failed: set[str] = set()
        # Saves of requests that finished with blocks not yet saved (completed in their last steps, the partial
        # block): sent with the next step's metadata, staged by the worker before that step's forward.
        self._final_saves: list[BlockTransfer] = []
        self._finished: list[str] = []  # finished requests whose blocks vLLM freed at once (the worker stages them)
        # Requests aborted while their async load runs, whose blocks vLLM keeps for the loader (delay_free), and
        # when they finished: the engine keeps stepping until the worker reports them (has_pending_push_work).
        self._held: dict[str, float] = {}
        self._released: list[str] = []  # aborted requests whose blocks vLLM freed at once (the worker fences them)
        self._saves = SavePlanner(cfg, self.geometry, groups, self._stats)
        self._inflight = SavesInFlight(cfg.save_wait_ms / 1000)  # a next turn waits for its history's last saves
        # At startup, before any step: a configuration error shows now, not at the first request. From
        # then on only the lookup thread talks to the daemon (and reconnects it).
        for link in self._links:
            link.get()
        self._lookups = Lookups(self._links, cfg.lookup_wait_ms / 1000, cfg.lookup_give_up_ms / 1000)
        self._pins: PinBook[Hit] = PinBook(self._lookups.release)  # synchronous loads' blocks, pinned until copied

    def layouts(self) -> list[KVLayout]:
        """The layout (and so the namespace) of each worker; empty until the daemon was reached."""
        return [link.layout for link in self._links if link.layout is not None]

    def _wanted(self, request: Request, num_computed_tokens: int) -> tuple[list[bytes], list[bytes], bytes]:
        """The kvbm block hashes worth looking up for ``request`` beyond its ``num_computed_tokens``, the vLLM
        block hashes a partial block after them may end at (empty without partial blocks), and the key of the
        block whose head may load where the request ends on a vLLM block's end (vLLM computes that last vLLM
        block; a first run of the prompt stored it in a full block or a partial block one vLLM block longer)."""
        block_tokens = self.geometry.block_tokens  # 0 until a link resolved it (the lookup thread retries)
        if not self.cfg.load or not block_tokens or request.request_id in self._load_failed:
            return [], [], b""
        vbs, k = self.geometry.vllm_block_size, self.geometry.known_k
        if num_computed_tokens % block_tokens and (num_computed_tokens % vbs or self.groups.count != 1):
            # A local hit inside a kvbm block is continued from its next vLLM block (one KV-cache group: a
            # sliding window's part-loaded block would need its own intactness rules).
            return [], [], b""
        # Leave at least one token to compute: vLLM needs logits for the last prompt token.
        max_vblocks = min((request.num_tokens - 1) // vbs, len(request.block_hashes))
        if max_vblocks * vbs <= num_computed_tokens:
            return [], [], b""
        hashes = [bytes(h) for h in request.block_hashes[k - 1 : max_vblocks // k * k : k]]
        vhashes = [bytes(h) for h in request.block_hashes[:max_vblocks]] if self._saves.partials else []
        if not vhashes and max_vblocks // k * block_tokens <= num_computed_tokens:
            return [], [], b""
        nxt = max_vblocks  # the vLLM block after the loadable ones: the last one of a stored block?
        next_block = bytes(request.block_hashes[nxt]) if vhashes and len(request.block_hashes) > nxt else b""
        return hashes, vhashes, next_block

    def on_new_request(self, request: Request) -> None:
        """A request arrived: its lookup goes to the daemon now, so the answer is there when it is scheduled."""
        hashes, vhashes, next_block = self._wanted(request, 0)
        if hashes or vhashes:
            # A sync load's hit is pinned with its lookup (from block 0: vLLM's own hit is mostly none; pinned again
            # when it asks if not), so a burst is answered with no more round trips.
            self._lookups.prefetch(request.request_id, hashes, vhashes, self.geometry.known_k, next_block,
                                   -1 if self.cfg.async_load else 0)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        block_tokens = self.geometry.block_tokens
        matched = partial = 0
        from_next = False
        hashes, vhashes, next_block = self._wanted(request, num_computed_tokens)
        if hashes or vhashes:
            # A synchronous load copies on the engine's step: its blocks are pinned first (kvbm...pins).
            pin_from = -1 if self.cfg.async_load else num_computed_tokens // block_tokens
            asked = (pin_from, len(hashes), len(vhashes))
            kept = self._pins.kept(rid, asked) if pin_from >= 0 else None
            got = kept or self._lookups.ask(rid, hashes, vhashes, self.geometry.known_k, next_block, pin_from)
            if got is None:
                return None, False  # not known yet: vLLM asks again next step
            matched, partial, from_next = got.blocks, got.partial, got.from_next
            if got.pins is not None:
                matched, partial, from_next = _pinned_run(got, pin_from)
                self._pins.keep(rid, asked, got)  # released if it is not loaded after all
            if not got.degraded and self._inflight.hold(rid, hashes, vhashes, self.geometry.known_k, next_block,
                                                        matched, partial, from_next):
                self._pins.drop(rid)
                self._lookups.forget(rid)  # asked again now: the answer is there by the next step
                self._lookups.prefetch(rid, hashes, vhashes, self.geometry.known_k, next_block, pin_from)
                return None, False
            self._stats["lookups"] += 1
            self._stats["hit_blocks"] += matched
            self._stats["hit_partial_vblocks"] = self._stats.get("hit_partial_vblocks", 0) + partial
        # A new state, also for a preempted request coming back: its saves cut short by the preemption are
        # planned again (the daemon answers those already stored with no slot, so nothing is copied twice).
        self._reqs[rid] = ReqState(request, local_tokens=num_computed_tokens, step=self._step,
                                   partial_from_next=from_next)
        ext = matched * block_tokens - num_computed_tokens
        if ext >= 0:
            ext += partial * self.geometry.vllm_block_size  # the partial block continues the full run
        if ext <= 0:
            self._pins.drop(rid)
            return 0, False
        return ext, bool(self.cfg.async_load)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        pinned = self._pins.pins_of(request.request_id)
        if num_external_tokens <= 0:
            self._pins.drop(request.request_id)
            return
        st.plan_load(num_external_tokens, self.geometry.known_k, self.geometry.vllm_block_size)
        if pinned is not None and st.load is not None:
            st.load.pins = {self._ranks[r]: v for r, v in pinned.slots_for(st.load.hashes).items()}
            st.load.unpinned_rest = pinned.cut
        self.hooks.stages.add(hit_tokens=num_external_tokens,
                              computed_after_hit_tokens=request.num_tokens - st.local_tokens - num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvbmConnectorMetadata:
        # The end of this step's scheduling: the next one may wait again.
        self._lookups.new_step(busy=getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0)
        step, self._step = self._step, self._step + 1
        self._pins.expire(step)
        meta = KvbmConnectorMetadata(k=self.geometry.known_k, weights=self.epoch.tag, step=step)
        meta.released, self._released = self._released, []
        meta.finished, self._finished = self._finished, []
        for rid in scheduler_output.preempted_req_ids or ():
            # vLLM freed its blocks (this step may reuse them): the worker finishes or drops the copies out of
            # them before the forward, and the stale ids are forgotten (they would match another request's).
            meta.preempted.append(rid)
            self._stats["preempted"] += 1
            st = self._reqs.get(rid)
            if st is not None and st.step < step:
                st.block_ids = []
                st.load = None
                self._pins.drop(rid)
            # else: preempted and admitted again in this same step (a reset with reset_running_requests,
            # pause "keep"): the state is the new admission's, its blocks and load are live.
        for st in self._reqs.values():
            if st.load is not None:
                if st.load.pins:
                    self._pins.hand(st.load.req_id, step)  # released once a worker copied them
                else:
                    self._pins.drop(st.load.req_id)
                meta.loads.append(st.load)
                if self.cfg.async_load:
                    self._load_pending.add(st.load.req_id)
                self._stats["loads"] += len(st.load.hashes)
                st.load = None
        meta.saves.extend(self._final_saves)
        self._final_saves = []
        if self.cfg.save:
            for new in scheduler_output.scheduled_new_reqs:
                st = self._reqs.get(new.req_id)
                if st is not None:
                    self._saves.plan(meta, st, new.num_computed_tokens,
                                     scheduler_output.num_scheduled_tokens.get(new.req_id, 0), None)
            cached = scheduler_output.scheduled_cached_reqs
            resumed = cached.resumed_req_ids or set()
            for i, req_id in enumerate(cached.req_ids):
                st = self._reqs.get(req_id)
                if st is not None:
                    new_ids = cached.new_block_ids[i] if cached.new_block_ids else None
                    self._saves.plan(meta, st, cached.num_computed_tokens[i],
                                     scheduler_output.num_scheduled_tokens.get(req_id, 0), new_ids, req_id in resumed)
        self._inflight.planned(meta.saves)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        done = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(done, KvbmWorkerMetadata):
            self._pins.copied(done.steps)
        for rid in connector_output.finished_recving or ():
            self._load_pending.discard(rid)
            self._held.pop(rid, None)
        for rid in connector_output.finished_sending or ():
            self._held.pop(rid, None)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        bad = getattr(connector_output, "invalid_block_ids", None)
        self._load_failed.update(replan_failed_loads(self._reqs, failed, bad, self.geometry.known_k))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._pins.drop(rid)  # pins no step was handed; a step's are released once it ran
        self._lookups.forget(rid)
        self._inflight.forget(rid)
        # kvbm never holds a finished request's blocks for its saves: vLLM frees them now, so a pause or a cache
        # reset right after (a weight sync; vLLM's in-process engine does not step in between) finds them free.
        # The worker stages what its saves have not read yet before the next forward (a finished request's) or
        # fences it (an aborted one's: what it saved so far stays, its last blocks are not saved). Only a request
        # whose async load is running is held: the loader writes into its blocks.
        delay_free = rid in self._load_pending
        if delay_free:
            self._held[rid] = time.monotonic()
        elif request.status == RequestStatus.FINISHED_ABORTED:
            self._released.append(rid)
        else:
            self._finished.append(rid)
            if st is not None and self.cfg.save and st.block_ids:
                finals = self._saves.finals(st, request.num_computed_tokens)
                self._final_saves.extend(finals)
                self._inflight.planned(finals)
        self._load_failed.discard(rid)
        return delay_free, {"kvbm": {**_health(self._links), "endpoint": self.endpoint,
                                     K_SETTING: self.geometry.known_k, **self._stats,
                                     "waited_for_saves": self._inflight.waited,
                                     "computed_past_saves": self._inflight.gave_up}}

    def reset_cache(self) -> None:
        """A new weights epoch: lookups, plans and saves made before it are never used under it."""
        self.epoch.reset()
        self._lookups.reset()
        self._load_failed.clear()
        self._pins.clear()  # the old epoch's blocks
        for st in self._reqs.values():
            st.stale = True  # running requests' KV is the old weights': never saved under the new epoch
        self._final_saves = []  # the old weights' KV; vLLM freed their blocks already
        self._inflight.clear()

    def holds_blocks(self) -> bool:
        """Whether the worker has work for a step with nothing scheduled: blocks vLLM keeps for an aborted
        request's running load, or finished requests' last saves to stage."""
        return bool(self._held or self._final_saves or self._finished)

    def frees_soon(self) -> bool:
        """Whether blocks held for kvbm are about to be freed: a request aborted while its async load ran finished
        less than a fence wait ago; one held longer (a stopped daemon) is not waited for, vLLM preempts."""
        horizon = time.monotonic() - max(self.cfg.fence_wait_ms, 1.0) / 1000
        return any(t >= horizon for t in self._held.values())

    def shutdown(self) -> None:
        self._lookups.close()  # the sessions' close releases what they pinned
        for link in self._links:
            link.close()


def _health(links: list[Link]) -> dict[str, Any]:
    """What a finished request's kv_transfer_params say of kvbm's health: degraded (and why), misconfigured."""
    degraded = [link for link in links if link.degraded]
    out: dict[str, Any] = {"degraded": bool(degraded), "misconfigured": any(link.misconfigured for link in degraded)}
    if degraded:
        out["reason"] = degraded[0].degraded_reason
    return out


def _pinned_run(got: Hit, pin_from: int) -> tuple[int, int, bool]:
    """A synchronous load's hit as far as its blocks from ``pin_from`` on are pinned (a block evicted since the
    lookup, no room in the session's budget: it ends where the pins end; a hit longer than the pin window pinned its
    head whole, and stands): (full blocks, the partial block's vLLM blocks, whether that is the head of the next
    block)."""
    pins = got.pins
    if pins is None or pins.count >= len(pins.keys):
        return got.blocks, got.partial, got.from_next
    return min(got.blocks, pin_from + pins.count), 0, False
