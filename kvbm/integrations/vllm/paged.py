"""The engine's paged KV cache as kvbm copies it: whole vLLM blocks of every layer, as opaque bytes."""

from __future__ import annotations

import torch

from kvbm.integrations.vllm.groups import NULL_BLOCK, SINGLE, KVGroups


class PagedCache:
    """Every layer's KV cache tensor and its block dimension; copies vLLM blocks to and from G2 slot bytes.

    Blocks are copied as the engine stores them, never re-laid out per token: vLLM's CPU backend
    interleaves K and V inside a block in an ISA-specific order. Under vLLM's hybrid KV cache manager each
    layer's bytes are in the blocks of its KV-cache group (:mod:`kvbm.integrations.vllm.groups`)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None, groups: KVGroups = SINGLE) -> None:
        # (layer, cache, block dim, group), in layer-name order
        self.layers: list[tuple[str, torch.Tensor, int, int]] = []
        self.groups = groups.count
        self.windowed = groups.sliding  # only a sliding-window group hands out vLLM's null block
        self.vblock_bytes = 0  # one vLLM block as the engine stores it, every layer
        for name in sorted(kv_caches):
            t = kv_caches[name]
            # The block dimension: [num_blocks, ...] on CPU, [2, num_blocks, ...] for flash layouts.
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks] if num_blocks else [0]
            bdim = dims[0] if dims else 0
            self.layers.append((name, t, bdim, groups.layer_group.get(name, 0)))
            self.vblock_bytes += t.select(bdim, 0).numel() * t.element_size()

    def copy(self, slot_view: torch.Tensor, vblocks: list[int], to_engine: bool, non_blocking: bool = False) -> None:
        """Copy ``vblocks`` (every layer, in order) from ``slot_view`` into the engine, or the other way.

        ``vblocks`` holds ``k`` ids per KV-cache group, group after group. A load skips vLLM's null block
        (a sliding-window block outside the hit's window); a save never reads one."""
        k = len(vblocks) // self.groups
        off = 0
        for name, cache, bdim, g in self.layers:
            for b in vblocks[g * k : (g + 1) * k]:
                blk = cache.select(bdim, b)
                n = blk.numel() * blk.element_size()
                if b == NULL_BLOCK and self.windowed:
                    if not to_engine:
                        raise ValueError(f"kvbm: a save of layer {name} names vLLM's null block")
                    off += n
                    continue
                host = slot_view[off : off + n].view(blk.dtype).view(blk.shape)
                if to_engine:
                    blk.copy_(host, non_blocking=non_blocking)
                else:
                    host.copy_(blk, non_blocking=non_blocking)
                off += n
