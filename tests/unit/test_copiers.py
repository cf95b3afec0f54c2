"""kvbm.manager.copiers: the (source medium, destination medium) table, over real tiers (shared-memory slot pools,
files on disk). Every copy is checked byte for byte; a missing source leaves no slot behind."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from kvbm.blocks import BlockKey
from kvbm.manager.copiers import COPIERS, Medium, copy_block, medium
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.host import HostTier
from kvbm.transfer import PlainFileIO

SLOT = 64 * 1024


def key(i):
    return BlockKey("copiers-0123456789abcdef", i.to_bytes(4, "big").ljust(32, b"\x00"))


def data(i):
    return np.random.default_rng(i).integers(0, 256, SLOT - 100, dtype=np.uint8).tobytes()


def test_every_pair_of_media_has_a_copier():
    assert set(COPIERS) == set(itertools.product(Medium, Medium))


def test_host_disk_host_round_trip_is_byte_exact_and_a_miss_leaves_no_slot(tmp_path):
    async def go():
        a, b = HostTier(4 * SLOT, SLOT, pin=False), HostTier(4 * SLOT, SLOT, pin=False)
        disk = DiskTier(tmp_path / "d", 16 << 20, PlainFileIO())
        for t in (a, b, disk):
            await t.start()
        try:
            assert (medium(a), medium(disk)) == (Medium.HOST_SLOTS, Medium.STORE)
            k = key(1)
            await a.put(k, data(1))
            n = len(data(1))
            assert await copy_block(k, a, disk, n)  # host slot -> store
            assert await copy_block(k, disk, b, n)  # store -> host slot
            assert await b.get(k) == data(1)
            c = HostTier(4 * SLOT, SLOT, pin=False)
            await c.start()
            try:
                assert await copy_block(k, b, c, n)  # slots -> slots (no mover: torch copy_)
                assert await c.get(k) == data(1)
            finally:
                await c.close()
            free = b.free_slots()
            assert not await copy_block(key(2), disk, b, n)  # not on disk: a miss
            assert b.free_slots() == free and b.nbytes(key(2)) is None  # its slot was given back
            assert not await copy_block(key(2), a, disk, n)
        finally:
            for t in (a, b, disk):
                await t.close()

    asyncio.run(go())
