"""A fixed pool of equal-size slots in one contiguous tensor: the shared core of G1 and G2.

No allocation per block: a block lives in a slot of ``slot_bytes`` bytes (blocks smaller than a slot
use its prefix). The manager moves blocks between two pools with a :class:`MemoryMover` in one batch.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator

import numpy as np
import torch

from kvbm.blocks import BlockKey
from kvbm.errors import TierFullError
from kvbm.tiers.base import StoredBlock, Tier


def readonly_tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor view of a possibly read-only array, used only as a copy source."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class SlotPoolTier(Tier):
    """A tier whose storage is ``pool`` (uint8, ``num_slots * slot_bytes``) cut into slots."""

    def __init__(self, pool: torch.Tensor, slot_bytes: int) -> None:
        if pool.dtype != torch.uint8 or pool.dim() != 1 or not pool.is_contiguous():
            raise ValueError("pool must be a contiguous 1-D uint8 tensor")
        if slot_bytes <= 0 or pool.numel() < slot_bytes:
            raise ValueError(f"pool of {pool.numel()} bytes holds no slot of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.num_slots = pool.numel() // slot_bytes
        super().__init__(self.num_slots * slot_bytes)
        self.pool = pool
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        # key -> (slot, nbytes, mtime); "pending" slots are allocated but not yet committed.
        self._index: dict[BlockKey, tuple[int, int, float]] = {}
        self._pending: dict[BlockKey, tuple[int, int]] = {}

    # -- slots -------------------------------------------------------------------------------------
    def slot_tensor(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.pool[start : start + (self.slot_bytes if nbytes is None else nbytes)]

    def block_tensor(self, key: BlockKey) -> torch.Tensor | None:
        """The pool view holding committed block ``key`` (valid while the block stays here)."""
        ent = self._index.get(key)
        return None if ent is None else self.slot_tensor(ent[0], ent[1])

    def slot_of(self, key: BlockKey) -> int | None:
        ent = self._index.get(key)
        return None if ent is None else ent[0]

    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, key: BlockKey, nbytes: int) -> int:
        """Reserve a slot for ``key`` to be filled by a copy (then :meth:`commit` or :meth:`abort`)."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"block of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        if key in self._pending:
            raise ValueError(f"{key} already has a pending slot")
        if not self._free:
            raise TierFullError(f"{self.name}: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._pending[key] = (slot, nbytes)
        return slot

    def commit(self, key: BlockKey) -> None:
        slot, nbytes = self._pending.pop(key)
        old = self._index.get(key)
        if old is not None:
            self._free.append(old[0])
        self._index[key] = (slot, nbytes, time.time())
        self.stats.puts += 1
        self.stats.bytes_in += nbytes

    def abort(self, key: BlockKey) -> None:
        ent = self._pending.pop(key, None)
        if ent is not None:
            self._free.append(ent[0])

    # -- Tier --------------------------------------------------------------------------------------
    async def put(self, key: BlockKey, data: memoryview | bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        slot = self.allocate(key, src.size)
        try:
            await asyncio.to_thread(self._copy_in, slot, src)
        except BaseException:
            self.abort(key)
            raise
        self.commit(key)

    def _copy_in(self, slot: int, src: np.ndarray) -> None:
        dst = self.slot_tensor(slot, src.size)
        if dst.is_cuda:
            dst.copy_(readonly_tensor(src))
        else:
            np.copyto(dst.numpy(), src)

    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        self.stats.gets += 1
        ent = self._index.get(key)
        if ent is None:
            self.stats.misses += 1
            return None
        slot, nbytes, _ = ent
        dst = np.frombuffer(out, dtype=np.uint8)[:nbytes]
        await asyncio.to_thread(lambda: torch.from_numpy(dst).copy_(self.slot_tensor(slot, nbytes)))
        self.stats.hits += 1
        self.stats.bytes_out += nbytes
        return nbytes

    async def delete(self, key: BlockKey) -> bool:
        return self.remove(key)

    def remove(self, key: BlockKey) -> bool:
        ent = self._index.pop(key, None)
        if ent is None:
            return False
        self._free.append(ent[0])
        self.stats.deletes += 1
        return True

    def nbytes(self, key: BlockKey) -> int | None:
        ent = self._index.get(key)
        return None if ent is None else ent[1]

    async def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:
        for key, (_slot, nbytes, mtime) in list(self._index.items()):
            if namespace is not None and key.namespace != namespace:
                continue
            yield StoredBlock(key=key, nbytes=nbytes, mtime=mtime, footprint=self.slot_bytes)

    def footprint(self, nbytes: int) -> int:
        return self.slot_bytes

    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes
