"""The block manager over real G1 (CPU tensors: no GPU here), G2 shared memory and G3 disk tiers."""

import asyncio
import os

import pytest
from needs import needs

from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import prefix_hashes
from kvbm.blocks.layout import KVLayout
from kvbm.manager.core import BlockManager
from kvbm.tiers.device import DeviceTier
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.host import HostTier
from kvbm.transfer import make_file_io, make_memory_mover, nixl_available

SLOT = 64 * 1024
LAYOUT = KVLayout(model="tiny", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)


def keys_for(tokens, layout=LAYOUT):
    return [BlockKey(layout.namespace, h) for h in prefix_hashes(tokens, layout.block_tokens)]


def payloads(keys):
    # Deterministic distinct bytes per block so a mix-up cannot pass.
    return {k: (k.hash * (LAYOUT.block_nbytes // 16 + 1))[: LAYOUT.block_nbytes] for k in keys}


class Stack:
    def __init__(self, tmp_path, g1=4, g2=8, g3=32, backend="plain", min_hits=0):
        from kvbm.config import TransferConfig

        cfg = TransferConfig(backend=backend)
        self.g1 = DeviceTier(g1 * SLOT, SLOT, "cpu")
        self.g2 = HostTier(g2 * SLOT, SLOT)
        self.g3 = DiskTier(str(tmp_path / "disk"), g3 * (SLOT + 8192), make_file_io(cfg), fsync=False)
        self.mgr = BlockManager([self.g1, self.g2, self.g3], make_memory_mover(cfg), min_hits_to_offload=min_hits)

    async def __aenter__(self):
        await self.mgr.start()
        return self.mgr

    async def __aexit__(self, *exc):
        await self.mgr.close()


def run(coro):
    return asyncio.run(coro)


BACKENDS = ["plain", pytest.param("nixl", marks=needs("nixl", nixl_available()[0], nixl_available()[1]))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_put_cascades_write_through_and_onboard_brings_blocks_back_exactly(tmp_path, backend):
    keys = keys_for(list(range(LAYOUT.block_tokens * 6)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path, backend=backend)
        async with st as mgr:
            for key in keys:
                assert await mgr.put(key, data[key]) == "G1"
            await mgr.drain()
            # Write-through: every block is in G2 and on disk too; G1 kept only the 4 most recent.
            assert mgr.registry.count("G1") == 4
            assert all(mgr.registry.holds("G3", k) for k in keys)
            assert all(mgr.registry.holds("G2", k) for k in keys)
            found = mgr.lookup(keys)
            assert len(found) == 6 and found.count("G1") == 4 and set(found) == {"G1", "G2"}
            assert mgr.lookup(keys)[5] == "G1"  # the newest block is never the LRU victim
            n = await mgr.onboard(keys[:4])
            assert n == 4
            for key in keys[:4]:
                assert bytes(mgr.device_tensor(key).numpy()) == data[key]
            assert st.g3.stats.corrupt == 0

    run(go())


def test_eviction_is_lru_and_demotes_instead_of_dropping(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 12)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path, g1=2, g2=3, g3=64)
        async with st as mgr:
            for key in keys:
                await mgr.put(key, data[key], cascade=False)
            # No cascade: overflow from G1 was demoted to G2, and from G2 to G3; nothing was dropped.
            assert mgr.registry.count("G1") == 2 and mgr.registry.count("G2") == 3
            assert all(mgr.where(k) for k in keys)
            assert mgr.where(keys[-1]) == ["G1"] and mgr.where(keys[0]) == ["G3"]
            assert mgr.stats.demotions >= len(keys) - 2
            for key in keys:
                assert await mgr.read(key) == data[key]

    run(go())


def test_pinned_blocks_are_never_evicted(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 4)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path, g1=2)
        async with st as mgr:
            await mgr.put(keys[0], data[keys[0]], cascade=False)
            await mgr.put(keys[1], data[keys[1]], cascade=False)
            with mgr.registry.pinned([keys[0]]):
                await mgr.put(keys[2], data[keys[2]], cascade=False)
                assert mgr.registry.holds("G1", keys[0]) and not mgr.registry.holds("G1", keys[1])
                with mgr.registry.pinned([keys[2]]):
                    # Both G1 slots pinned: the next block lands one tier down.
                    assert await mgr.put(keys[3], data[keys[3]], cascade=False) == "G2"

    run(go())


def test_onboard_returns_longest_leading_run_and_stages_disk_blocks_through_g2(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 5)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path)
        async with st as mgr:
            for key in keys[:3] + keys[4:]:
                await mgr.put(key, data[key], tier="G3")
            assert mgr.lookup(keys) == ["G3", "G3", "G3"]
            assert await mgr.onboard(keys) == 3
            for key in keys[:3]:
                assert mgr.where(key) == ["G1", "G2", "G3"]
                assert bytes(mgr.device_tensor(key).numpy()) == data[key]
            assert mgr.device_tensor(keys[4]) is None
            assert mgr.describe()["manager"]["onboard_blocks"] == 3

    run(go())


def test_restart_recovers_disk_blocks_and_corrupt_block_is_a_miss(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 3)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path)
        async with st as mgr:
            for key in keys:
                await mgr.put(key, data[key], tier="G2")
            assert await mgr.offload(keys, durable=True) == 3
        # "Restart": new tiers, new manager, same disk directory.
        st2 = Stack(tmp_path)
        path = st2.g3.path_for(keys[1])
        with open(path, "r+b") as f:  # flip one payload byte of block 1
            f.seek(os.path.getsize(path) - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        async with st2 as mgr:
            assert mgr.lookup(keys) == ["G3", "G3", "G3"]
            # Block 1 fails its checksum on the way up: the run stops there, nothing bad is served.
            assert await mgr.onboard(keys) == 1
            assert bytes(mgr.device_tensor(keys[0]).numpy()) == data[keys[0]]
            assert mgr.device_tensor(keys[1]) is None
            assert st2.g3.stats.corrupt == 1
            assert mgr.lookup(keys) == ["G1"]

    run(go())


def test_frequency_filter_keeps_one_off_blocks_off_disk(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 2)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path, min_hits=1)
        async with st as mgr:
            for key in keys:
                await mgr.put(key, data[key], tier="G2", cascade=False)
            await mgr.onboard(keys[:1])  # block 0 is hit once
            await mgr.offload(keys, durable=False)
            await mgr.drain()
            assert mgr.registry.holds("G3", keys[0]) and not mgr.registry.holds("G3", keys[1])
            assert mgr.stats.filtered == 1

    run(go())


def test_concurrent_onboards_of_the_same_prefix_coalesce(tmp_path):
    keys = keys_for(list(range(LAYOUT.block_tokens * 4)))
    data = payloads(keys)

    async def go():
        st = Stack(tmp_path)
        async with st as mgr:
            for key in keys:
                await mgr.put(key, data[key], tier="G3")
            results = await asyncio.gather(*(mgr.onboard(keys) for _ in range(5)))
            assert results == [4] * 5
            assert st.g3.stats.hits == 4  # each block read from disk once
            assert mgr.registry.count("G1") == 4

    run(go())


def test_the_owed_writes_journal_lives_in_the_tier_that_says_it_has_a_local_dir(tmp_path):
    """The manager asks a tier where node-local state survives a restart (``Tier.local_dir``), instead of
    checking for the disk tier's class: a disk tier keeps the journal in its directory, memory tiers have none."""
    disk = DiskTier(str(tmp_path / "disk"), 4 * (SLOT + 8192), make_file_io(), fsync=False)
    host = HostTier(4 * SLOT, SLOT)
    assert disk.local_dir == tmp_path / "disk" and host.local_dir is None
    host.local_dir = tmp_path / "host-state"  # any tier may name one; the manager uses the first indexed
    host.local_dir.mkdir()

    async def go():
        mgr = BlockManager([host, disk], make_memory_mover())
        await mgr.start()
        try:
            return mgr.owed_writes.journal
        finally:
            await mgr.close()

    assert run(go()) == tmp_path / "host-state" / ".kvbm-owed.journal"
