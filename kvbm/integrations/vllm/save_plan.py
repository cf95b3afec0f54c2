"""The connector's save planning (scheduler side): which kvbm blocks of a request the worker saves, and when."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbm.integrations.vllm.config import ConnectorConfig
from kvbm.integrations.vllm.geometry import Geometry
from kvbm.integrations.vllm.groups import NULL_BLOCK, KVGroups
from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class ReqState:
    # The request itself: its block_hashes grow as it decodes, so output blocks are saved as they fill up.
    request: Request
    local_tokens: int = 0  # vLLM's own prefix-cache hit when the request was admitted
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    load: BlockTransfer | None = None
    load_from: int = -1  # the first kvbm block of its load (-1: none); a failed load re-saves from here
    saved_blocks: int = 0  # kvbm blocks of this request already handed to the worker to save
    step: int = 0  # the scheduler step the state was made in (a preemption of that step is an earlier state's)
    stale: bool = False  # computed under weights before a cache reset: never saved
    partial: bytes = b""  # the partial block this request loaded or saved last (saved once)
    partial_from_next: bool = False  # its lookup's partial block is the head of the next stored block

    def full_blocks(self, k: int) -> int:
        """kvbm blocks whose every token is known (prompt and output alike)."""
        return len(self.request.block_hashes) // k if k else 0

    def transfer(self, idx: range, k: int) -> BlockTransfer:
        """The kvbm blocks ``idx`` of this request with the ``k`` vLLM block ids each covers, per group."""
        hashes = self.request.block_hashes
        return BlockTransfer(self.request.request_id, [bytes(hashes[(i + 1) * k - 1]) for i in idx],
                             [[b for ids in self.block_ids for b in ids[i * k : (i + 1) * k]] for i in idx])

    def plan_load(self, num_external_tokens: int, k: int, vbs: int) -> None:
        """The load of the ``num_external_tokens`` vLLM allocated past its local hit, onto this request's blocks."""
        # External tokens follow the local prefix-cache hit (request.num_computed_tokens is still 0 here), which
        # may end inside a kvbm block (vLLM caches its own smaller blocks): that block loads only its vLLM blocks
        # past the hit (``skip``). The matched run then always reaches past that block (get_num_new_matched_tokens).
        v0 = self.local_tokens // vbs
        first_block, skip = divmod(v0, k)
        end_block, j = divmod(v0 + num_external_tokens // vbs, k)
        self.load = self.transfer(range(first_block, end_block), k)
        if skip and self.load.block_ids:
            self.load.block_ids[0] = self.load.block_ids[0][skip:]
            self.load.skip = skip
        # A partial block after the full ones: its own key, j vLLM blocks; or the head of the next stored block (a
        # full block or a partial block of j + 1, keyed by its last vLLM block): all of it but that last one,
        # which vLLM computes (the same bytes, stored already).
        full_next = j == k - 1 and self.partial_from_next
        if j:
            first = end_block * k
            self.partial = bytes(self.request.block_hashes[first + j - (0 if self.partial_from_next else 1)])
            self.load.hashes.append(self.partial)
            self.load.block_ids.append([b for ids in self.block_ids for b in ids[first : first + j]])
            if self.partial_from_next:
                self.load.tail = 1
        self.load_from = first_block
        self.saved_blocks = end_block + (1 if j and full_next else 0)  # a full block loaded is stored already

    def held_vblocks(self) -> int:
        """vLLM blocks allocated to the request in every group."""
        return min((len(ids) for ids in self.block_ids), default=0)


class SavePlanner:
    """Plans each request's saves from its vLLM blocks: full kvbm blocks as they fill, the partial block at the
    end of a prompt's prefill and at the finish."""

    def __init__(self, cfg: ConnectorConfig, geometry: Geometry, groups: KVGroups, stats: dict[str, int]) -> None:
        self.cfg, self.geometry, self.groups, self.stats = cfg, geometry, groups, stats

    @property
    def partials(self) -> bool:
        """Whether partial blocks are saved and loaded: one KV-cache group, of full attention. A sliding one (every
        layer windowed) names vLLM's null block before its window after a prefix hit, and blocks its window freed
        while decoding: a partial block would need the full blocks' intactness rules."""
        return (self.cfg.partial_blocks and self.groups.count == 1 and not self.groups.sliding
                and self.geometry.known_k > 1)

    def plan(self, meta: KvbmConnectorMetadata, st: ReqState, computed: int, scheduled: int, new_block_ids: Any,
             resumed: bool = False) -> None:
        """A scheduled request's step: take its new vLLM blocks, hand the worker the kvbm blocks this step
        completes, and its prompt's partial block when its prefill ends in this step."""
        if resumed:
            # A request resumed after preemption: vLLM lists its whole block list again, which replaces the
            # old one (appending it would save later blocks from the request's early vLLM blocks).
            st.block_ids = [list(ids) for ids in new_block_ids] if new_block_ids else []
        elif new_block_ids:
            if not st.block_ids:
                st.block_ids = [[] for _ in new_block_ids]
            for ids, new in zip(st.block_ids, new_block_ids, strict=True):
                ids.extend(new or ())
        self.queue(meta, st, computed + scheduled, computed)
        prompt = st.request.num_prompt_tokens
        if self.cfg.save and computed < prompt <= computed + scheduled:
            # The prompt's prefill ends in this step: its tail past the last full kvbm block is a partial
            # block, so the same prompt sent again is cached as far as vLLM's own prefix cache would.
            tail = self.partial(st, prompt)
            if tail is not None:
                meta.saves.append(tail)

    def queue(self, meta: KvbmConnectorMetadata, st: ReqState, ready_tokens: int, computed: int) -> bool:
        """Hand the worker the request's kvbm blocks whose KV exists once ``ready_tokens`` are computed;
        whether any were."""
        k = self.geometry.known_k
        if not k or meta.k != k or st.stale:
            return False  # geometry unknown (daemon never reached), or KV of weights before a reset: no saves
        # Blocks whose every token is known and computed by the end of this step, prompt and output alike.
        done = min(st.full_blocks(k), ready_tokens // self.geometry.block_tokens, st.held_vblocks() // k)
        while self.groups.sliding and st.saved_blocks < done and not self.intact(st, st.saved_blocks, computed):
            # A sliding-window group already freed part of this block (or never held it: a hit's blocks
            # outside the window): it cannot be saved. A gap; a later hit stops before it.
            st.saved_blocks += 1
        if done > st.saved_blocks:
            tr = st.transfer(range(st.saved_blocks, done), k)
            if self.partials:  # each full block supersedes the partial blocks of its leading vLLM blocks
                vh = st.request.block_hashes
                tr.covers = [[bytes(h) for h in vh[i * k : (i + 1) * k - 1]] for i in range(st.saved_blocks, done)]
            meta.saves.append(tr)
            self.stats["saves"] += done - st.saved_blocks
            st.saved_blocks = done
            return True
        return False

    def finals(self, st: ReqState, computed: int) -> list[BlockTransfer]:
        """A finished request's last saves: blocks completed in its last steps (and, with async scheduling, the
        step whose token was not appended yet when it was planned: every token but the last sampled one has KV),
        and its partial block."""
        meta = KvbmConnectorMetadata(k=self.geometry.known_k)
        self.queue(meta, st, computed, computed)
        tail = self.partial(st, computed)
        if tail is not None:
            meta.saves.append(tail)
        for tr in meta.saves:
            tr.final = True
        return meta.saves

    def partial(self, st: ReqState, computed: int) -> BlockTransfer | None:
        """A finished request's tokens past its last full kvbm block, as many of vLLM's blocks as hold KV: a
        partial block, keyed by the vLLM hash of its last block (never a full block's key, which is every
        ``k``-th). None when there is none, or its full blocks were not all saved (a hit could not reach it)."""
        if not self.partials or st.stale:
            return None
        k, vbs = self.geometry.known_k, self.geometry.vllm_block_size
        vfull = min(computed // vbs, len(st.request.block_hashes), st.held_vblocks())
        full, j = divmod(vfull, k)
        if not j or st.saved_blocks != full:
            return None
        key = bytes(st.request.block_hashes[vfull - 1])
        if key == st.partial:
            return None  # loaded or saved already (a prompt whose answer stayed inside the same vLLM block)
        st.partial = key
        ids = [b for group in st.block_ids for b in group[full * k : full * k + j]]
        self.stats["partial_saves"] = self.stats.get("partial_saves", 0) + 1
        return BlockTransfer(st.request.request_id, [key], [ids], partial=True)

    def intact(self, st: ReqState, i: int, computed: int) -> bool:
        """Whether every group still holds all vLLM blocks of the request's kvbm block ``i``."""
        k = self.geometry.known_k
        if any(NULL_BLOCK in ids[i * k : (i + 1) * k] for ids in st.block_ids):
            return False
        return self.groups.intact(i * k, self.geometry.vllm_block_size, computed)


def replan_failed_loads(reqs: dict[str, ReqState], failed: set[str], bad: set[int] | None, k: int) -> set[str]:
    """After loads came up short (``failed`` requests, ``bad`` vLLM block ids): every request vLLM recomputes from
    a failed load on, or that computed on top of a block that did not load, has its saves from there planned
    again; the requests whose own load failed (returned: recomputed from then on)."""
    if bad:
        failed |= {rid for rid, st in reqs.items()
                   if st.load_from >= 0 and any(not bad.isdisjoint(ids) for ids in st.block_ids)}
        for st in reqs.values():
            # Any request holding a block that did not load (another's sync load vLLM cached at allocation and
            # this one hit) computed on top of it: its saves from there on were dropped by the worker and are
            # planned again once vLLM recomputed them.
            first = min((i for ids in st.block_ids for i, b in enumerate(ids) if b in bad), default=None)
            if first is not None and k:
                st.saved_blocks = min(st.saved_blocks, first // k)
                st.partial = b""  # its partial block, loaded or saved, is saved again too
    for rid in failed:
        st = reqs.get(rid)
        if st is not None and st.load_from >= 0:
            # vLLM recomputes from the failed load on: those blocks are saved once they are computed, its partial
            # block too (remembered as loaded, it was never saved again: gone from the daemon, it stayed gone).
            st.saved_blocks = min(st.saved_blocks, st.load_from)
            st.load_from = -1
            st.partial = b""
    return failed
