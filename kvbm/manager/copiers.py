"""How one block is copied between two tiers, chosen by (source medium, destination medium).

Three media: a slot pool in host memory (G2, or G1 on a CPU host), a slot pool in GPU memory (G1 on a GPU
host), and a store (disk, S3: bytes in, bytes out). Slots are filled in place (allocate, copy, commit; an
abort on any failure) and read under :meth:`SlotPoolTier.hold`, so a slot is never reused while copied from.
Every copier returns False when the source no longer has a good copy (a miss, never wrong bytes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.tiers.base import Tier
from kvbm.tiers.pool import SlotPoolTier


class Medium(StrEnum):
    HOST_SLOTS = "host_slots"
    GPU_SLOTS = "gpu_slots"
    STORE = "store"


def medium(tier: Tier) -> Medium:
    if isinstance(tier, SlotPoolTier):
        return Medium.GPU_SLOTS if tier.pool.is_cuda else Medium.HOST_SLOTS
    return Medium.STORE


Copier = Callable[[BlockKey, Any, Any, int, Any], Awaitable[bool]]


async def slots_to_slots(key: BlockKey, src: SlotPoolTier, dst: SlotPoolTier, n: int, mover: Any) -> bool:
    """Pool to pool (G2 <-> G1): the memory mover (NIXL or torch) when there is one, else ``copy_``."""
    with src.hold(key) as view:  # the source slot is not reused while we copy from it
        if view is None:
            return False
        slot = dst.allocate(key, n)
        try:
            if mover is not None:
                await asyncio.to_thread(mover.copy, [(view, dst.slot_tensor(slot, n))])
            else:
                await asyncio.to_thread(dst.slot_tensor(slot, n).copy_, view)
        except BaseException:
            dst.abort(key)
            raise
    dst.commit(key)
    return True


async def store_to_host_slot(key: BlockKey, src: Tier, dst: SlotPoolTier, n: int, _mover: Any) -> bool:
    """Disk or S3 into a host slot: read straight into the slot's memory (no intermediate copy).

    The slot is committed only when the tier read and checked exactly the ``n`` bytes it was sized for: a block of
    another length (an object overwritten since it was indexed) would leave the rest of the slot stale."""
    slot = dst.allocate(key, n)
    try:
        got = await src.get_into(key, memoryview(dst.slot_tensor(slot, n).numpy()))
    except BaseException:
        dst.abort(key)
        raise
    if got != n:
        dst.abort(key)
        if got is not None:
            src.stats.short_reads += 1
        return False
    dst.commit(key)
    return True


async def host_slot_to_store(key: BlockKey, src: SlotPoolTier, dst: Tier, _n: int, _mover: Any) -> bool:
    """A host slot to disk or S3: written from the slot's memory."""
    with src.hold(key) as view:  # an Evict meanwhile must not hand the slot to a new block
        if view is None:
            return False
        await dst.put(key, memoryview(view.numpy()))
    return True


async def via_bytes(key: BlockKey, src: Tier, dst: Tier, _n: int, _mover: Any) -> bool:
    """Anything else (store to store, GPU slots to or from a store): read the bytes, then write them."""
    data = await src.get(key)
    if data is None:
        return False
    await dst.put(key, data)
    return True


H, G, S = Medium.HOST_SLOTS, Medium.GPU_SLOTS, Medium.STORE
COPIERS: dict[tuple[Medium, Medium], Copier] = {
    (H, H): slots_to_slots, (H, G): slots_to_slots, (G, H): slots_to_slots, (G, G): slots_to_slots,
    (S, H): store_to_host_slot,
    (H, S): host_slot_to_store,
    (S, S): via_bytes, (S, G): via_bytes, (G, S): via_bytes,
}


async def copy_block(key: BlockKey, src: Tier, dst: Tier, n: int, mover: Any = None) -> bool:
    """Copy ``key`` (``n`` payload bytes) from ``src`` into ``dst``; False if ``src`` has no good copy."""
    return await COPIERS[medium(src), medium(dst)](key, src, dst, n, mover)
