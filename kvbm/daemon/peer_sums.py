"""The xxh3-64 of each block in G2, as a peer read's Pin answers it (:mod:`kvbm.daemon.peer_serve`).

A committed slot's bytes never change, so a block's checksum is kept with the slot it was computed in, and dropped
when the block leaves G2. A Pin of blocks not summed yet hashes them on its critical path (about 1 ms per 8 MiB,
plus a thread hop that takes tens of ms on a busy machine: 40 ms for a 12-block pin next to a running engine). So
blocks are summed **ahead**, in the background, as they are stored: each one's slot is referenced while a worker
thread hashes it (the slot cannot be reused meanwhile) and the sum is kept only if the block is still in that slot.
A block read from a peer keeps the checksum its bytes were verified against instead (:meth:`known_now`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import numpy as np

from kvbm.blocks import BlockKey
from kvbm.blocks.format import checksum
from kvbm.index.registry import Registry
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier

log = logging.getLogger(__name__)

AHEAD_MAX = 4096  # blocks waiting to be summed ahead at most (past it the oldest are summed at their first Pin)
AHEAD_BATCH = 16  # blocks per thread hop


def slot_checksum(g2: SlotPoolTier, slot: int, nbytes: int) -> int:
    """The xxh3-64 of the ``nbytes`` in G2's ``slot`` (the block format's payload checksum)."""
    return checksum(memoryview(np.asarray(g2.slot_tensor(slot, nbytes).numpy())))


class SlotChecksums:
    """Owns the G2 blocks' checksums: (slot, xxh3-64) per block, summed ahead of their first Pin."""

    def __init__(self, registry: Registry, g2: SlotPoolTier) -> None:
        self.g2 = g2
        self.ahead = True  # off once closed
        self._sums: dict[BlockKey, tuple[int, int]] = {}
        self._waiting: dict[BlockKey, None] = {}  # stored, not summed yet (insertion order: the oldest first)
        self._task: asyncio.Task[None] | None = None
        self.computed = 0  # at a Pin
        self.known = 0  # at a Pin, already summed
        self.summed_ahead = 0
        self.from_reads = 0  # taken from a peer read's verified checksums (not hashed again here)
        self._registry = registry
        registry.listeners.append(self._on_registry)

    def all_known(self, slots: Iterable[tuple[BlockKey, int]]) -> bool:
        """Whether every (key, slot) has its checksum known for that slot (a Pin answers with no thread hop)."""
        return all(self._sums.get(k, (-1, 0))[0] == s for k, s in slots)

    def sums(self, leased: Iterable[tuple[BlockKey, int, int]]) -> list[int]:
        """The checksum of each (key, slot, nbytes) leased now, computed here for those not known (a thread may
        call it: the leases keep the slots)."""
        out = []
        for key, slot, nbytes in leased:
            got = self._sums.get(key)
            if got is None or got[0] != slot:
                got = (slot, slot_checksum(self.g2, slot, nbytes))
                self._sums[key] = got
                self.computed += 1
            else:
                self.known += 1
            out.append(got[1])
        return out

    def known_now(self, verified: Iterable[tuple[BlockKey, int, int]]) -> None:
        """Blocks this daemon just read from a peer and committed into G2, as (key, slot, xxh3-64): their bytes were
        checked against that sum, so it is kept as theirs (a peer of this daemon reading them gets it with no hash)."""
        for key, slot, s in verified:
            if self.g2.slot_of(key) == slot:
                self._waiting.pop(key, None)
                self._sums[key] = (slot, s)
                self.from_reads += 1

    def _on_registry(self, kind: str, tier: str, keys: list[BlockKey]) -> None:
        if tier != TierName.G2:
            return
        for k in keys:  # stored (again: maybe in the slot it had) or gone: what was known of it is not kept
            self._sums.pop(k, None)
            self._waiting.pop(k, None)
        if kind != "stored" or not self.ahead:
            return
        for k in keys:
            self._waiting[k] = None
        while len(self._waiting) > AHEAD_MAX:
            del self._waiting[next(iter(self._waiting))]
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._sum_ahead())
            except RuntimeError:  # stored from outside the loop (a test's direct call): summed at the Pin
                pass

    async def _sum_ahead(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch: list[tuple[BlockKey, int, int]] = []
            while self._waiting and len(batch) < AHEAD_BATCH:
                key = next(iter(self._waiting))
                del self._waiting[key]
                got = self.g2.acquire(key)  # the slot stays ours (not reused) until unref
                if got is not None:
                    batch.append((key, *got))
            if not batch:
                continue
            fut = loop.run_in_executor(None, lambda b=batch: [slot_checksum(self.g2, s, n) for _k, s, n in b])
            # The slots are given back when the thread is done with them, even if this task is cancelled first.
            fut.add_done_callback(lambda _f, b=batch: [self.g2.unref(s) for _k, s, _n in b])
            try:
                sums = await asyncio.shield(fut)
            except Exception as e:  # never fatal: those blocks are summed at their first Pin
                log.warning("summing %d blocks ahead of their pins failed: %s", len(batch), e)
                continue
            for (key, slot, _n), s in zip(batch, sums, strict=True):
                if self.g2.slot_of(key) == slot:  # still this block's slot: its bytes are the ones hashed
                    self._sums[key] = (slot, s)
                    self.summed_ahead += 1

    def close(self) -> None:
        """Stop summing ahead (a daemon closing its peer-read server)."""
        self.ahead = False
        if self._on_registry in self._registry.listeners:
            self._registry.listeners.remove(self._on_registry)
        if self._task is not None:
            self._task.cancel()
        self._waiting.clear()
