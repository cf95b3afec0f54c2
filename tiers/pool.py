"""A fixed pool of equal-size slots in one contiguous tensor: the shared core of G1 and G2.

No allocation per block: a block lives in a slot of ``slot_bytes`` bytes (blocks smaller than a slot
use its prefix). The manager moves blocks between two pools with a :class:`MemoryMover` in one batch.

Slot lifetime has one owner, this pool: every slot carries a reference count. The index entry of a
committed block holds one reference, a pending allocation holds one, and every reader holds one for as
long as it copies out of the slot (an in-flight copy to another tier, a worker that onboarded the block,
a quarantined store of a worker whose lease ran out). :meth:`remove` detaches the key at once (lookups
stop finding it), but the slot returns to the free list only when its last reference drops, so a slot
is never handed to a new block while anything can still read or write it. Committing over a key that
is already committed is a no-op (the first copy stays; both are the same content-addressed bytes).
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError, TierFullError
from kvbm.tiers.base import StoredBlock, Tier


class SlotBusyError(KvbmError):
    """The key already has a pending slot (another copy of it is being written)."""


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
        self._refs: list[int] = [0] * self.num_slots
        # key -> (slot, nbytes, mtime); "pending" slots are allocated but not yet committed.
        self._index: dict[BlockKey, tuple[int, int, float]] = {}
        self._pending: dict[BlockKey, tuple[int, int]] = {}

    # -- slots -------------------------------------------------------------------------------------
    def slot_tensor(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.pool[start : start + (self.slot_bytes if nbytes is None else nbytes)]

    def block_tensor(self, key: BlockKey) -> torch.Tensor | None:
        """The pool view holding committed block ``key`` (valid while the block stays here; hold a
        reference with :meth:`hold` or :meth:`acquire` across any await)."""
        ent = self._index.get(key)
        return None if ent is None else self.slot_tensor(ent[0], ent[1])

    def slot_of(self, key: BlockKey) -> int | None:
        ent = self._index.get(key)
        return None if ent is None else ent[0]

    def free_slots(self) -> int:
        return len(self._free)

    def detached_slots(self) -> int:
        """Slots neither free, committed nor pending: removed blocks still referenced by a reader or a
        quarantined writer."""
        return self.num_slots - len(self._free) - len(self._index) - len(self._pending)

    def is_pending(self, key: BlockKey) -> bool:
        return key in self._pending

    def allocate(self, key: BlockKey, nbytes: int) -> int:
        """Reserve a slot for ``key`` to be filled by a copy (then :meth:`commit` or :meth:`abort`)."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"block of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        if key in self._pending:
            raise SlotBusyError(f"{key} already has a pending slot")
        if not self._free:
            raise TierFullError(f"{self.name}: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._refs[slot] = 1
        self._pending[key] = (slot, nbytes)
        return slot

    def allocate_many(self, keys: list[BlockKey], nbytes: int) -> list[int]:
        """:meth:`allocate` of a batch of distinct keys: all of them, or none (TierFullError, SlotBusyError)."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"block of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot")
        pending = self._pending
        busy = [k for k in keys if k in pending]
        if busy:
            raise SlotBusyError(f"{busy[0]} already has a pending slot")
        free = self._free
        if len(free) < len(keys):
            raise TierFullError(f"{self.name}: {len(keys)} slots wanted, {len(free)} of {self.num_slots} free")
        slots = free[len(free) - len(keys) :][::-1]  # the same slots, in the same order, as allocate() one by one
        del free[len(free) - len(keys) :]
        refs = self._refs
        for key, slot in zip(keys, slots, strict=True):
            refs[slot] = 1
            pending[key] = (slot, nbytes)
        return slots

    def commit(self, key: BlockKey) -> bool:
        """Make ``key``'s pending slot its committed copy; False (and the new slot released) when the
        key is already committed, whose slot readers may be copying from."""
        slot, nbytes = self._pending.pop(key)
        if key in self._index:
            self.unref(slot)
            return False
        self._index[key] = (slot, nbytes, time.time())
        self.stats.puts += 1
        self.stats.bytes_in += nbytes
        return True

    def commit_many(self, keys: list[BlockKey]) -> list[BlockKey]:
        """:meth:`commit` of a batch (one clock read); returns the keys newly committed."""
        now = time.time()
        pending, index = self._pending, self._index
        done: list[BlockKey] = []
        nbytes = 0
        for key in keys:
            slot, n = pending.pop(key)
            if key in index:
                self.unref(slot)
                continue
            index[key] = (slot, n, now)
            done.append(key)
            nbytes += n
        self.stats.puts += len(done)
        self.stats.bytes_in += nbytes
        return done

    def abort(self, key: BlockKey) -> None:
        ent = self._pending.pop(key, None)
        if ent is not None:
            self.unref(ent[0])

    def detach(self, key: BlockKey) -> int | None:
        """Forget ``key``'s pending slot but keep its reference (the caller :meth:`unref` s it later):
        for a writer that may still be copying into it."""
        ent = self._pending.pop(key, None)
        return None if ent is None else ent[0]

    def acquire(self, key: BlockKey) -> tuple[int, int] | None:
        """Take a reference on committed block ``key``'s slot: (slot, nbytes), or None if absent."""
        ent = self._index.get(key)
        if ent is None:
            return None
        self._refs[ent[0]] += 1
        return ent[0], ent[1]

    def unref(self, slot: int) -> None:
        """Drop one reference; the slot is free again when none is left."""
        n = self._refs[slot] - 1
        if n < 0:
            raise AssertionError(f"{self.name}: slot {slot} released more often than taken")
        self._refs[slot] = n
        if n == 0:
            self._free.append(slot)

    @contextmanager
    def hold(self, key: BlockKey) -> Iterator[torch.Tensor | None]:
        """The view of committed block ``key`` (None if absent), its slot referenced while inside."""
        got = self.acquire(key)
        if got is None:
            yield None
            return
        try:
            yield self.slot_tensor(*got)
        finally:
            self.unref(got[0])

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
        with self.hold(key) as view:
            if view is None:
                self.stats.misses += 1
                return None
            nbytes = view.numel()
            dst = np.frombuffer(out, dtype=np.uint8)[:nbytes]
            await asyncio.to_thread(lambda: torch.from_numpy(dst).copy_(view))
        self.stats.hits += 1
        self.stats.bytes_out += nbytes
        return nbytes

    async def delete(self, key: BlockKey) -> bool:
        return self.remove(key)

    def remove(self, key: BlockKey) -> bool:
        """Detach committed ``key``; its slot is freed once no reader references it."""
        ent = self._index.pop(key, None)
        if ent is None:
            return False
        self.unref(ent[0])
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

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["detached_slots"] = self.detached_slots()
        return d
