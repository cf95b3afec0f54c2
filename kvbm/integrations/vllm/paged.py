"""The engine's paged KV cache as kvbm copies it: whole vLLM blocks of every layer, as opaque bytes."""

from __future__ import annotations

import torch


class PagedCache:
    """Every layer's KV cache tensor and its block dimension; copies vLLM blocks to and from G2 slot bytes.

    Blocks are copied as the engine stores them, never re-laid out per token: vLLM's CPU backend
    interleaves K and V inside a block in an ISA-specific order."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None) -> None:
        self.layers: list[tuple[str, torch.Tensor, int]] = []  # (layer, cache, block dim), in layer-name order
        self.vblock_bytes = 0  # one vLLM block as the engine stores it, every layer
        for name in sorted(kv_caches):
            t = kv_caches[name]
            # The block dimension: [num_blocks, ...] on CPU, [2, num_blocks, ...] for flash layouts.
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks] if num_blocks else [0]
            bdim = dims[0] if dims else 0
            self.layers.append((name, t, bdim))
            self.vblock_bytes += t.select(bdim, 0).numel() * t.element_size()

    def copy(self, slot_view: torch.Tensor, vblocks: list[int], to_engine: bool, non_blocking: bool = False) -> None:
        """Copy ``vblocks`` (every layer, in order) from ``slot_view`` into the engine, or the other way."""
        off = 0
        for _name, cache, bdim in self.layers:
            for b in vblocks:
                blk = cache.select(bdim, b)
                n = blk.numel() * blk.element_size()
                host = slot_view[off : off + n].view(blk.dtype).view(blk.shape)
                if to_engine:
                    blk.copy_(host, non_blocking=non_blocking)
                else:
                    host.copy_(blk, non_blocking=non_blocking)
                off += n
