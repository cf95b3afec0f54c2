"""Registry bookkeeping and the G1/G2 slot-pool tiers (G1 runs on CPU tensors here: no GPU)."""

import asyncio
import os

import pytest
import torch

from kvbm.blocks import BlockKey
from kvbm.errors import TierFullError
from kvbm.index.registry import Registry
from kvbm.tiers.device import DeviceTier
from kvbm.tiers.host import HostTier, shm_path

NS = "m-0123456789abcdef"


def k(i: int) -> BlockKey:
    return BlockKey(NS, i.to_bytes(16, "big"))


def test_lru_victims_skip_pinned_and_respect_touch():
    r = Registry(["G2"])
    for i in range(4):
        r.add("G2", k(i), 10)
    assert r.used("G2") == 40 and r.count("G2") == 4
    assert r.victims("G2", 10, 40) == [k(0)]
    r.touch("G2", k(0))
    assert r.victims("G2", 10, 40) == [k(1)]
    r.pin([k(1)])
    assert r.victims("G2", 20, 40) == [k(2), k(3)]
    with pytest.raises(LookupError):
        r.pin([k(0), k(2), k(3)])
        r.victims("G2", 10, 40)
    r.unpin([k(0), k(1), k(2), k(3)])
    assert not r.is_pinned(k(1))
    assert r.victims("G2", 5, 100) == []


def test_match_prefix_returns_fastest_tier_of_leading_run():
    r = Registry(["G1", "G2", "G3"])
    r.add("G3", k(0), 1)
    r.add("G1", k(0), 1)
    r.add("G2", k(1), 1)
    r.add("G3", k(3), 1)
    assert r.match_prefix([k(0), k(1), k(2), k(3)]) == ["G1", "G2"]
    assert r.where(k(0)) == ["G1", "G3"]
    assert len(r) == 3
    r.remove("G1", k(0))
    assert r.match_prefix([k(0)]) == ["G3"]


def test_device_tier_is_cpu_here_and_round_trips():
    g1 = DeviceTier(4 << 20, 1 << 20)
    assert g1.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    data = os.urandom(1 << 20)

    async def go():
        await g1.put(k(1), data)
        assert await g1.get(k(1)) == data
        assert bytes(g1.block_tensor(k(1)).cpu().numpy()) == data
        assert await g1.get(k(2)) is None
        assert await g1.delete(k(1)) and not g1.contains(k(1))

    asyncio.run(go())
    assert g1.stats.hits == 1 and g1.stats.misses == 1


def test_host_pool_is_shared_memory_visible_to_another_mapping_and_full_is_an_error():
    g2 = HostTier(2 << 20, 1 << 20)
    try:
        assert shm_path(g2.shm_name).exists()
        other = HostTier.attach(g2.shm_name, 2 << 20, 1 << 20)
        data = os.urandom(1000)

        async def go():
            await g2.put(k(1), data)
            slot = g2.slot_of(k(1))
            assert bytes(other.slot_tensor(slot, 1000).numpy()) == data
            # A write through the other mapping is visible to the owner.
            other.slot_tensor(slot, 4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
            assert (await g2.get(k(1)))[:4] == bytes([1, 2, 3, 4])
            await g2.put(k(2), data)
            with pytest.raises(TierFullError):
                await g2.put(k(3), data)
            with pytest.raises(ValueError):
                g2.allocate(k(4), (1 << 20) + 1)

        asyncio.run(go())
        other.release()
        assert g2.free_slots() == 0 and g2.used_bytes() == 2 << 20
    finally:
        g2.release()
    assert not shm_path(g2.shm_name).exists()


def test_host_pool_attach_fails_cleanly_for_unknown_name():
    with pytest.raises(FileNotFoundError):
        HostTier.attach("kvbm-no-such-pool", 1 << 20, 1 << 20)


def test_named_pool_left_by_a_dead_owner_is_replaced_but_a_live_one_is_not(tmp_path):
    import subprocess
    import sys

    name = f"kvbm-test-{os.getpid()}-named"
    code = ("import os, sys; from kvbm.tiers.host import HostTier; "
            f"HostTier(1 << 20, 1 << 20, {name!r}); print('up', flush=True); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "up" and shm_path(name).exists()  # killed: the pool file stayed
    g2 = HostTier(1 << 20, 1 << 20, name)  # the dead owner's pool is taken over
    try:
        with pytest.raises(FileExistsError, match="in use"):
            HostTier(1 << 20, 1 << 20, name)
    finally:
        g2.release()
    assert not shm_path(name).exists()
