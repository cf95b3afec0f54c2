"""The engine's paged KV cache as kvbm copies it: whole vLLM blocks of every layer, as opaque bytes."""

from __future__ import annotations

import ctypes
import time

import torch

from kvbm.integrations.vllm.groups import NULL_BLOCK, SINGLE, KVGroups
from kvbm.integrations.vllm.stages import Stages, stages_of


def runs(ids: list[int], skip_null: bool) -> list[tuple[int, int, int]]:
    """``ids`` as runs of consecutive block ids: (position in ``ids``, first id, length). With ``skip_null``
    vLLM's null block is left out (it starts no run and ends one)."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if skip_null and b == NULL_BLOCK:
            continue
        if out and out[-1][0] + out[-1][2] == i and out[-1][1] + out[-1][2] == b:
            pos, first, n = out[-1]
            out[-1] = (pos, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


class PagedCache:
    """Every layer's KV cache tensor and its block dimension; copies vLLM blocks to and from G2 slot bytes.

    Blocks are copied as the engine stores them, never re-laid out per token: vLLM's CPU backend
    interleaves K and V inside a block in an ISA-specific order. Under vLLM's hybrid KV cache manager each
    layer's bytes are in the blocks of its KV-cache group (:mod:`kvbm.integrations.vllm.groups`). Each copy is
    counted in ``stages`` (``copy_in_*`` into the engine, ``copy_out_*`` out of it)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None, groups: KVGroups = SINGLE,
                 stages: Stages | None = None) -> None:
        # (layer, cache, block dim, group, one vLLM block's bytes of the layer), in layer-name order
        self.layers: list[tuple[str, torch.Tensor, int, int, int]] = []
        self.groups = groups.count
        self.windowed = groups.sliding  # only a sliding-window group hands out vLLM's null block
        self.vblock_bytes = 0  # one vLLM block as the engine stores it, every layer
        self.stages = stages if stages is not None else stages_of("worker")
        for name in sorted(kv_caches):
            t = kv_caches[name]
            # The block dimension: [num_blocks, ...] on CPU, [2, num_blocks, ...] for flash layouts.
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks] if num_blocks else [0]
            bdim = dims[0] if dims else 0
            n = t.select(bdim, 0).numel() * t.element_size()
            self.layers.append((name, t, bdim, groups.layer_group.get(name, 0), n))
            self.vblock_bytes += n
        # A CPU engine's caches are contiguous with blocks first (vLLM's CPU backend): block b of a layer is the
        # n bytes at base + b * n, copied by address, with no tensor made per copy.
        self.flat = bool(self.layers) and all(
            t.device.type == "cpu" and bdim == 0 and t.is_contiguous() for _, t, bdim, _, _ in self.layers)

    def copy(self, slot_view: torch.Tensor, vblocks: list[int], to_engine: bool, non_blocking: bool = False,
             slot_k: int | None = None, skip: int = 0) -> None:
        """Copy ``vblocks`` (every layer, in order) from ``slot_view`` into the engine, or the other way.

        ``vblocks`` holds ``k`` ids per KV-cache group, group after group. The slot holds, layer after layer,
        that layer's blocks in order; a run of consecutive block ids is one copy per layer (vLLM hands out a
        fresh request's blocks mostly in runs). A load skips vLLM's null block (a sliding-window block outside
        the hit's window); a save never reads one.

        Part of a stored block: the slot holds ``slot_k`` vLLM blocks per layer (default ``k``) and ``vblocks``
        are its blocks ``skip`` to ``skip + k`` (a full block loaded past vLLM's own hit, or short of a prompt's
        last token)."""
        t0 = time.perf_counter()
        k = len(vblocks) // self.groups
        slot_k = k if slot_k is None else slot_k
        if skip < 0 or skip + k > slot_k:
            raise ValueError(f"kvbm: vLLM blocks {skip}..{skip + k} of a slot holding {slot_k} per layer")
        need = sum(slot_k * n for _, _, _, _, n in self.layers)
        have = slot_view.numel() * slot_view.element_size()
        if have < need:
            raise ValueError(f"kvbm: a slot of {have} B cannot hold {slot_k * self.groups} vLLM blocks ({need} B)")
        flat = self.flat and slot_view.device.type == "cpu" and slot_view.is_contiguous()
        slot = slot_view.data_ptr()
        off = copied = 0
        for name, cache, bdim, g, n in self.layers:
            ids = vblocks[g * k : (g + 1) * k]
            if self.windowed and not to_engine and NULL_BLOCK in ids:
                raise ValueError(f"kvbm: a save of layer {name} names vLLM's null block")
            base = cache.data_ptr()
            for pos, first, count in runs(ids, self.windowed):
                a = off + (skip + pos) * n
                if flat:
                    # One memmove on this thread, the GIL released: a torch copy_ of this size forks the
                    # intra-op threads and joins them per layer and run, which costs milliseconds when the
                    # engine's cores are busy (measured: 0.14 of a memcpy at 2 threads, `kvbm bench copy`).
                    eng, host_at = base + first * n, slot + a
                    if to_engine:
                        ctypes.memmove(eng, host_at, count * n)
                    else:
                        ctypes.memmove(host_at, eng, count * n)
                else:
                    # The run's blocks, block-major as the slot holds them ([count, ...] whatever the block dim).
                    blk = cache.narrow(bdim, first, count).movedim(bdim, 0)
                    host = slot_view[a : a + count * n].view(cache.dtype).view(blk.shape)
                    if to_engine:
                        blk.copy_(host, non_blocking=non_blocking)
                    else:
                        host.copy_(blk, non_blocking=non_blocking)
                copied += count * n
            off += slot_k * n
        d = "in" if to_engine else "out"
        # With non_blocking (a GPU save on a side stream) the seconds are the enqueue's, not the copy's.
        self.stages.add(**{f"copy_{d}_bytes": copied, f"copy_{d}_s": time.perf_counter() - t0,
                           f"copy_{d}_vblocks": sum(1 for b in vblocks if not (self.windowed and b == NULL_BLOCK))})
