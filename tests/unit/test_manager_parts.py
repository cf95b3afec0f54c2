"""The manager's parts alone: each built from a ManagerState of real tiers, without a BlockManager."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path

from kvbm.blocks import BlockKey
from kvbm.config import TransferConfig
from kvbm.errors import TierUnavailableError
from kvbm.index.registry import Registry
from kvbm.manager import BlockManager
from kvbm.manager.cascade import WriteThrough
from kvbm.manager.room import Room
from kvbm.manager.state import ManagerState
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.host import HostTier
from kvbm.transfer import make_file_io

SLOT = 4096
PARTS = ("cascade", "room", "moves", "external", "knowledge", "owed", "copiers", "policy", "failures")
MANAGER = Path(__file__).resolve().parents[2] / "kvbm" / "manager"


def key(i: int) -> BlockKey:
    return BlockKey("tiny-0123456789abcdef", i.to_bytes(8, "big") * 2)


def disk(path: Path, blocks: int) -> DiskTier:
    io = make_file_io(TransferConfig(backend="plain"))
    return DiskTier(str(path / "disk"), blocks * (SLOT + 8192), io, fsync=False)


def state_of(*tiers) -> ManagerState:
    return ManagerState(list(tiers), Registry([t.name for t in tiers]))


async def trusted(_tier: str, keys) -> set[BlockKey]:
    """real_copies for tiers without a shared store: every indexed entry counts."""
    return set(keys)


def test_no_part_imports_the_manager():
    """The parts see the manager only through ManagerState: not even a TYPE_CHECKING import of BlockManager."""
    for part in PARTS:
        src = (MANAGER / f"{part}.py").read_text()
        froms = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
        core = [n.module for n in froms
                if n.module == "kvbm.manager.core" or any(a.name == "BlockManager" for a in n.names)]
        assert not core, f"kvbm/manager/{part}.py imports the manager"


def test_the_manager_core_imports_neither_the_s3_package_nor_prometheus():
    code = ("import sys, kvbm.manager; print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', "
            "'kvbm.tiers.s3', 'kvbm.daemon.metrics', 'aiobotocore'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_room_alone_demotes_the_lru_block_before_evicting_it(tmp_path):
    g2, g3 = HostTier(2 * SLOT, SLOT), disk(tmp_path, 8)
    s = state_of(g2, g3)
    moved: list[tuple[BlockKey, str]] = []

    async def move(k: BlockKey, dst: str) -> bool:
        moved.append((k, dst))
        s.registry.add(dst, k, SLOT)
        return True

    async def go() -> None:
        for t in (g2, g3):
            await t.start()
        room = Room(s, move, trusted)
        for i in range(2):
            async with room.held(g2, SLOT):
                await g2.put(key(i), bytes([i]) * SLOT)
                s.registry.add("G2", key(i), SLOT)
        await room.reserve(g2, SLOT)  # full: the LRU block goes, after it was demoted to G3
        for t in (g2, g3):
            await t.close()

    asyncio.run(go())
    assert moved == [(key(0), "G3")]
    assert s.registry.where(key(0)) == ["G3"] and s.registry.where(key(1)) == ["G2"]
    assert s.stats.demotions == 1 and s.stats.evictions == 1


def test_write_through_alone_owes_a_tier_that_is_down(tmp_path):
    g2, g3 = HostTier(4 * SLOT, SLOT), disk(tmp_path, 4)
    s = state_of(g2, g3)
    s.registry.add("G2", key(1), SLOT)

    async def down(_k: BlockKey, _dst: str) -> bool:
        raise TierUnavailableError("G3 is down")

    async def go() -> bool:
        await g3.start()
        wt = WriteThrough(s, down, trusted, max_pending=8, max_concurrent=2)
        ok = await wt.cascade(key(1))
        counts = wt.owed.counts()
        wt.owed.cancel()
        await g3.close()
        await g2.close()  # its pool in /dev/shm (left, a later test that checks for leftover pools failed)
        assert counts == {"G3": 1}
        return ok

    assert asyncio.run(go()) is False
    assert s.stats.cascade_failures == 1 and s.stats.errors == {"G3:TierUnavailableError": 1}


def test_a_registry_swapped_in_after_construction_reaches_every_part(tmp_path):
    """The manager bench replaces ``mgr.registry``; before, room/moves/cascade kept the old one."""
    g2, g3 = HostTier(4 * SLOT, SLOT), disk(tmp_path, 8)
    mgr = BlockManager([g2, g3])
    mgr.registry = Registry(["G2", "G3"])

    async def go() -> None:
        await mgr.start()
        for i in range(6):  # more than G2 holds: room evicts, moves copy, the cascade writes through
            await mgr.put(key(i), bytes([i]) * SLOT)
        await mgr.drain()
        await mgr.close()

    asyncio.run(go())
    assert all(mgr.registry.holds("G3", key(i)) for i in range(6))
    assert mgr.registry.count("G2") == 4


def test_a_purge_of_g2_waits_for_the_write_through_below_and_names_the_one_still_under_way(tmp_path):
    """Purges.settle before a purge of G2 alone: the write-throughs of blocks G3 lacks land first; one still under way
    after the wait is named (the Evict skips it: its only copy is still being written down); a block G3 holds is not
    waited for; a purge of every tier, or of blocks already gone below, does not wait."""
    g2, g3 = HostTier(4 * SLOT, SLOT), disk(tmp_path, 4)
    s = state_of(g2, g3)
    for i in (1, 2, 3):
        s.registry.add("G2", key(i), SLOT)
    s.registry.add("G3", key(3), SLOT)

    async def go() -> None:
        await g3.start()
        wt, purges, release = _purges_over(s, {key(2)})
        assert wt.schedule(key(1)) and wt.schedule(key(2))
        assert set(wt.of([key(1), key(2), key(3)])) == {key(1), key(2)}
        assert await purges.settle([key(1), key(2), key(3)], ["G2"]) == {key(2)}
        assert s.registry.holds("G3", key(1))
        assert await purges.settle([key(2)], ["G2", "G3"]) == set()  # every tier: nothing to keep
        assert await purges.settle([key(2)], ["G2"], gone=True) == set()
        release.set()
        await wt.drain()
        assert s.registry.holds("G3", key(2)) and wt.of([key(1), key(2)]) == {}
        wt.owed.cancel()
        await g3.close()
        await g2.close()

    asyncio.run(go())


def test_a_purge_of_g2_sees_a_durable_stores_direct_write_through_and_skips_a_block_owed_below(tmp_path):
    """Not only background cascades: a durable store's direct ``cascade()`` (and the owed drain's) is waited for too;
    a block no remaining tier holds whose write there failed (owed, an outage) is skipped, never purged."""
    g2, g3 = HostTier(4 * SLOT, SLOT), disk(tmp_path, 4)
    s = state_of(g2, g3)
    for i in (1, 2):
        s.registry.add("G2", key(i), SLOT)

    async def go() -> None:
        await g3.start()
        wt, purges, release = _purges_over(s, {key(1), key(2)})
        direct = asyncio.ensure_future(wt.cascade(key(1)))  # as offload(durable=True) calls it
        await asyncio.sleep(0)
        assert set(wt.of([key(1)])) == {key(1)}
        assert await purges.settle([key(1)], ["G2"]) == {key(1)}  # still under way: skipped
        release.set()
        assert await direct and await purges.settle([key(1)], ["G2"]) == set()  # landed on G3: purge G2
        wt.owed.owe("G3", key(2))  # its write to G3 failed in an outage: G2 holds its only copy
        assert await purges.settle([key(2)], ["G2"]) == {key(2)}
        assert await purges.settle([key(2)], ["G2", "G3"]) == set()  # every tier: nothing to keep
        wt.owed.cancel()
        await g3.close()
        await g2.close()

    asyncio.run(go())


def test_a_purge_of_g2_starts_again_the_write_through_a_burst_shed_and_lets_it_land(tmp_path):
    """A background cascade shed past ``max_pending`` left the block in G2 alone, never owed: an Evict of G2 deleted
    its only copy. The purge starts it again first and waits for it as for the others."""
    g2, g3 = HostTier(4 * SLOT, SLOT), disk(tmp_path, 4)
    s = state_of(g2, g3)
    for i in (1, 2):
        s.registry.add("G2", key(i), SLOT)

    async def go() -> None:
        await g3.start()
        wt, purges, release = _purges_over(s, {key(1)}, max_pending=1)
        assert wt.schedule(key(1)) and not wt.schedule(key(2))  # the second is shed: one queued at most
        assert s.stats.shed_offloads == 1 and not s.registry.holds("G3", key(2))
        assert await purges.settle([key(2)], ["G2"]) == set()
        assert s.registry.holds("G3", key(2))  # written down before the purge of G2 takes its copy
        assert wt.catch_up([key(2)]) == 0  # once: no longer shed
        release.set()
        await wt.drain()
        wt.owed.cancel()
        await g3.close()
        await g2.close()

    asyncio.run(go())


def _purges_over(s, slow: set[BlockKey], max_pending: int = 8):  # type: ignore[no-untyped-def]
    """A WriteThrough whose moves land at once but those of ``slow`` (after ``release``), and a Purges over it
    that waits 0.3 s. Call it inside the test's event loop."""
    from kvbm.manager.purges import Purges

    release = asyncio.Event()

    async def move(k: BlockKey, dst: str) -> bool:
        await (release.wait() if k in slow else asyncio.sleep(0.01))
        s.registry.add(dst, k, SLOT)
        return True

    wt = WriteThrough(s, move, trusted, max_pending=max_pending, max_concurrent=4)
    purges = Purges(s, None, wt.owed, wt.of, wt.catch_up)  # settle needs no moves
    purges.wait_s = 0.3
    return wt, purges, release
