"""The block manager: decides where blocks live and moves them between tiers.

Tiers are ordered fastest first (G1 device, G2 host, G3 disk, G4 S3; any subset). Policy:

* **Offload is write-through.** A block stored into a tier is copied, in the background, to every
  lower tier, so a block acknowledged as durable survives the loss of the faster tiers.
* **Eviction demotes.** When a tier is full, its least-recently-used unpinned blocks leave; one that no
  lower tier holds yet is first written to the next tier that has room. A persistent tier (disk) never
  lets go of a block no lower tier really holds: if the demotion fails it keeps the block, and the write
  that needed the room fails with TierFullError. A memory tier drops it (counted in ``dropped``).
* **Only real copies count.** A tier write that raised (failed or shed) is not recorded; ``offload(...,
  durable=True)`` counts only blocks that reached disk or S3.
* **Background work never dies.** A cascade or demotion that raises anything is counted per tier and
  exception type (``errors``), logged once per kind (then at most once a minute), and leaves the block
  where it was; the rest of the write-through goes on.
* **Frequency filter.** With ``min_hits_to_offload > 0``, G3 only receives blocks that were hit at
  least that often (as Dynamo does for G2->G3, to spare the disk one-off blocks); they still go to G4.
* **Onboard** finds the longest run of leading blocks held anywhere and brings them up to the target
  tier, staging through G2 when they come from disk or S3.
* **Pins** keep blocks that are being read or written from being evicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import msgspec

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError, TierFullError, TierUnavailableError
from kvbm.index.registry import Registry
from kvbm.manager.cascade import WriteThrough
from kvbm.manager.deletes import delete_copies
from kvbm.manager.external import ExternalStores
from kvbm.manager.failures import FAILURE_LOG_EVERY_S, FailureLog
from kvbm.manager.knowledge import IndexSync
from kvbm.manager.leases import Lease, ReadLeases
from kvbm.manager.moves import Moves
from kvbm.manager.owed import CATCH_UP_EVERY_S, DEFAULT_MAX_OWED
from kvbm.manager.owed_journal import JOURNAL_NAME
from kvbm.manager.placement import PlacementPolicy
from kvbm.manager.policy import PERSISTENT
from kvbm.manager.purges import Purges
from kvbm.manager.reads import Reads
from kvbm.manager.room import Room
from kvbm.manager.scopes import Reconciled, reconcile_once
from kvbm.manager.state import CopyObserver, ManagerState, ManagerStats, StateField
from kvbm.manager.supersede import Supersedes
from kvbm.manager.tiers_off import off_rows, start_tiers
from kvbm.tiers.base import Tier
from kvbm.tiers.names import TierName
from kvbm.tiers.pool import SlotPoolTier
from kvbm.transfer.memory import MemoryMover

log = logging.getLogger(__name__)

__all__ = ["CATCH_UP_EVERY_S", "FAILURE_LOG_EVERY_S", "PERSISTENT", "BlockManager", "FailureLog", "ManagerStats"]


class BlockManager:
    """Tracks blocks across tiers and moves them. Safe to use from one event loop."""

    def __init__(self, tiers: Sequence[Tier], mover: MemoryMover | None = None, *, min_hits_to_offload: int = 0,
                 max_pending_cascades: int = 1024, max_concurrent_cascades: int = 32,
                 max_owed_blocks: int = DEFAULT_MAX_OWED, eviction: str = "lru",
                 policy_options: dict[str, Any] | None = None) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KvbmError(f"duplicate tier names: {names}")
        # The one state every part shares; the parts get it and the callables they use, never the manager.
        self.state = ManagerState(list(tiers), Registry(names), mover=mover, min_hits_to_offload=min_hits_to_offload)
        if eviction != "lru":  # admission, eviction and promotion: kvbm.manager.placement
            self.state.placement = PlacementPolicy(self.state.registry, names, eviction, **(policy_options or {}))
        self.index = IndexSync(self.state)  # blocks found elsewhere (kvbm.manager.knowledge)
        self.room = Room(self.state, self._move, self.index.real_copies)  # reservations and eviction
        self.moves = Moves(self.state, self.room)  # coalesced copies between tiers
        # Background cascades (bounded; see kvbm.manager.cascade) and the write-throughs owed after an outage.
        self.write_through = WriteThrough(self.state, self._move, self.index.real_copies, max_pending_cascades,
                                          max_concurrent_cascades, max_owed_blocks)
        self.owed_writes = self.write_through.owed
        self.external = ExternalStores(self.state, self.room, self.write_through.schedule, self.moves.in_flight)
        self.reads = Reads(self.state, self.moves, self.write_through)  # onboards and reads (kvbm.manager.reads)
        self.leases = ReadLeases(self.state, lambda keys, tier, stopped: self.onboard(keys, to=tier, stopped=stopped))
        self.supersedes = Supersedes(self.state, self.moves.in_flight)  # partial blocks a full one covers
        # An Evict: the write-throughs in flight into the purged tiers undone, those below them let land first.
        self.purges = Purges(self.state, self.moves, self.owed_writes, self.write_through.of,
                             self.write_through.catch_up)
        self._pools_registered = False
        self.reconciled = Reconciled()  # bucket scopes (a namespace, None: all) reconciled with the disk, bounded

    def _move(self, key: BlockKey, dst: str) -> Awaitable[bool]:
        return self.moves.move(key, dst)

    # The state's fields, read (and for registry/observe_copy set) through the manager as callers always have.
    tiers: StateField[list[Tier]] = StateField()
    by_name: StateField[dict[str, Tier]] = StateField()
    registry: StateField[Registry] = StateField()  # set: every part reads it per call, so all see the new one
    stats: StateField[ManagerStats] = StateField()
    mover: StateField[MemoryMover | None] = StateField()
    observe_copy: StateField[CopyObserver] = StateField()

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, *, index: bool | tuple[str, ...] = True, optional: tuple[str, ...] = ()) -> None:
        """Start every tier and index what the persistent ones already hold: all tiers (True), none
        (False), or the tiers of the given kinds (e.g. ``("disk",)``, leaving a big bucket for later). A tier of
        a kind in ``optional`` that cannot start is turned off (:mod:`kvbm.manager.tiers_off`)."""
        await start_tiers(self.state, optional)
        if self.mover is not None and not self._pools_registered:
            for tier in self.tiers:
                if isinstance(tier, SlotPoolTier):
                    self.mover.register(tier.pool)
            self._pools_registered = True
        if index:
            for tier in self.tiers:
                if index is True or tier.kind in index:
                    await self.index_tier(tier.name)
                    if tier.local_dir is not None and self.owed_writes.journal is None:
                        # What was owed to S3 when the last run stopped (kvbm.manager.owed), the disk now indexed.
                        await self.owed_writes.resume(tier.local_dir / JOURNAL_NAME, read_only=bool(tier.read_only))

    async def index_tier(self, name: str, namespace: str | None = None, *, refresh: bool = False) -> int:
        """Load what tier ``name`` holds into the registry (see :meth:`IndexSync.index_tier`). The first listing
        of a shared tier (or of a namespace in it) is also reconciled with the disk above it: what the disk holds
        and the listing lacks is owed to it (:meth:`OwedWrites.reconcile`); an admin rescan (``refresh``) is not."""
        n = await self.index.index_tier(name, namespace, refresh=refresh)
        if not refresh:
            await reconcile_once(self.state, self.reconciled, self.owed_writes, name, namespace)
        return n

    async def drain(self) -> None:
        """Wait until every background cascade has finished."""
        await self.write_through.drain()
        await self.supersedes.drain()

    async def close(self) -> None:
        await self.drain()
        await self.owed_writes.close()
        await self.drain()
        if self.mover is not None:  # its registrations of the tiers' pools (and a NIXL pump thread) go first
            await asyncio.to_thread(self.mover.close)
        for tier in self.tiers:
            await tier.close()

    # -- queries ---------------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> list[str]:
        """The fastest tier of each block in the longest leading run of ``keys`` held anywhere."""
        found = self.registry.match_prefix(keys)
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        self.stats.lookup_hit_blocks += len(found)
        return found

    def lookup_hashes(self, namespace: str, hashes: Sequence[bytes]) -> list[str]:
        """:meth:`lookup` straight from a request's hashes (no BlockKey per block on the hot path)."""
        found = self.registry.match_hashes(namespace, hashes)
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        self.stats.lookup_hit_blocks += len(found)
        return found

    def relookup(self, keys: Sequence[BlockKey], before: Sequence[str]) -> list[str]:
        """:meth:`lookup` again after a bucket probe (see :meth:`IndexSync.relookup`)."""
        return self.index.relookup(keys, before)

    def where(self, key: BlockKey) -> list[str]:
        return self.registry.where(key)

    def held_run(self, keys: Sequence[BlockKey]) -> list[str]:
        """The fastest tier of each block of the leading run of ``keys`` held anywhere (no statistics: what an
        onboard would bring up)."""
        return self.registry.match_prefix(keys)

    # -- writes ----------------------------------------------------------------------------------------
    async def put(
        self, key: BlockKey, data: memoryview | bytes, tier: str | None = None, *, cascade: bool = True
    ) -> str:
        """Store ``data`` as ``key`` in ``tier`` (default: the fastest) and write it through below."""
        order = self.tiers if tier is None else [self.by_name[tier], *self.state.below(tier)]
        for t in order:
            try:
                await self._store(t, key, data)
            except (TierFullError, TierUnavailableError) as e:
                log.debug("%s cannot take %s: %s", t.name, key, e)
                continue
            if cascade:
                self.write_through.schedule(key)
            return t.name
        raise TierFullError(f"no tier could store {key}")

    async def offload(self, keys: Sequence[BlockKey], *, durable: bool = False) -> int:
        """Write blocks already held in a fast tier through to the lower tiers.

        With ``durable`` the call returns once each block is on a persistent tier (disk or S3); it
        returns how many blocks are durable (or, without it, how many cascades were started).
        """
        self.stats.offloads += 1
        self.stats.offload_blocks += len(keys)
        if durable:
            async def recheck() -> None:  # stale shared-tier entries re-checked in one batch, not one HEAD each
                for tier in self.tiers:
                    if tier.kind == "s3":
                        await self.index.real_copies(tier.name, keys)

            return await self.write_through.durably(keys, recheck)
        started = 0
        for key in keys:
            started += self.write_through.schedule(key)
        return started

    # -- external stores (a worker copies into G2 slots itself; kvbm.manager.external) --------------------------
    async def prepare_store(self, keys: Sequence[BlockKey], nbytes: int, tier: str = TierName.G2,
                            admit: Callable[[int], None] | None = None) -> list[int | None]:
        """Reserve a slot in pool tier ``tier`` for each key; None for keys already stored there or being
        stored right now (another worker's prepared store, a prefetch or a cascade copying it in). ``admit(n)``
        hears how many slots that is before room is made (a caller's budget check: it may raise).

        The caller fills the slots (e.g. a GPU worker copying through shared memory) and then calls
        :meth:`complete_store`. Slots stay reserved, and out of eviction's reach, until then.
        """
        return await self.external.prepare(keys, nbytes, tier, admit)

    def complete_store(self, keys: Sequence[BlockKey], ok: bool = True, *, cascade: bool = True,
                       partial: bool = False) -> int:
        """Commit (or abort) slots from :meth:`prepare_store`; committed blocks write through below. ``partial``:
        they are partial blocks, evicted first until hit (:mod:`kvbm.index.partials`)."""
        done = self.external.complete(keys, ok, cascade=cascade, partial=partial)
        self.stats.offload_blocks += done
        return done

    def supersede(self, fulls: Sequence[BlockKey], covers: Sequence[Sequence[BlockKey]]) -> int:
        """Drop from every tier, in the background, the partial blocks ``covers[i]`` of each held full block
        ``fulls[i]`` (:mod:`kvbm.manager.supersede`); how many drops started."""
        return self.supersedes.schedule(fulls, covers)

    def detach_store(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Lease]:
        """Abort prepared stores whose writer may still be copying (see :meth:`ExternalStores.detach`); their
        slots stay held by the leases returned until :meth:`release`."""
        return self.external.detach(keys)

    # -- external reads (a worker copies a block out of a G2 slot itself; kvbm.manager.leases) -----------------
    async def reserve_read(self, keys: Sequence[BlockKey], tier: str = TierName.G2,
                           stopped: list[BaseException] | None = None) -> list[Lease]:
        """Bring the leading held run of ``keys`` into pool tier ``tier`` and lease each block's slot to the
        caller (pinned there, the slot referenced) until :meth:`release`."""
        return await self.leases.reserve(keys, tier, stopped)

    def detach_read(self, leases: Iterable[Lease]) -> None:
        """Let leased blocks be evicted again while their slots stay referenced (a reader that may still copy)."""
        self.leases.detach(leases)

    def release(self, leases: Iterable[Lease]) -> int:
        """Give back what leases (read, or detached stores) still hold; returns slots released."""
        return self.leases.release(leases)

    async def _store(self, tier: Tier, key: BlockKey, data: memoryview | bytes) -> None:
        fp = tier.footprint(len(data))
        async with self.room.held(tier, fp):
            await tier.put(key, data)
            self.registry.add(tier.name, key, fp)

    # -- reads -----------------------------------------------------------------------------------------
    async def onboard(self, keys: Sequence[BlockKey], to: str | None = None, *, hit: bool = True,
                      stopped: list[BaseException] | None = None) -> int:
        """Bring the longest leading run of ``keys`` held anywhere up into tier ``to`` (default G1).

        Returns how many leading blocks are now in ``to``; a block that fails its integrity check on
        the way ends the run there (it is a miss, never served). ``hit=False`` (a prefetch, which the request's
        own Onboard follows): not counted as a reference of the blocks, so the placement policy counts it once.
        """
        return await self.reads.onboard(keys, to, hit=hit, stopped=stopped)

    async def read(self, key: BlockKey) -> bytes | None:
        """The block's bytes from the fastest tier that has a good copy."""
        return await self.reads.read(key)

    def device_tensor(self, key: BlockKey) -> object | None:
        """The G1 view of an onboarded block (a CUDA tensor on a GPU host)."""
        g1 = self.by_name.get(TierName.G1)
        return g1.block_tensor(key) if isinstance(g1, SlotPoolTier) else None

    async def delete(self, keys: Sequence[BlockKey], tiers: Sequence[str] | None = None, *,
                     gone: bool = False) -> int:
        """Remove blocks from the given tiers (default all), a batch per tier; returns copies removed. ``gone``:
        another process already deleted them from disk/S3 (a purge), so only the indexes are updated.

        Only what a tier really deleted leaves the index: a key whose delete failed (a failed DeleteObjects, a
        per-key error) is still held there and stays indexed. A tier that fails does not stop the others; the
        first failure is raised once every tier was tried (TierUnavailableError naming the tier)."""
        return await delete_copies(self.state, keys, tiers, gone=gone)

    # -- reporting -------------------------------------------------------------------------------------
    def describe(self) -> dict[str, object]:
        tiers = []
        for t in self.tiers:
            d = t.describe()
            d["blocks"] = self.registry.count(t.name)
            tiers.append(d)
        tiers += off_rows(self.state)
        s = msgspec.structs.asdict(self.stats)
        s["errors"] = dict(self.stats.errors)
        s.update(self.registry.partials.counts())
        s["hit_rate"] = (self.stats.lookup_hit_blocks / self.stats.lookup_blocks) if self.stats.lookup_blocks else 0.0
        s["pending_cascades"] = len(self.write_through.pending)
        s["owed"] = self.owed_writes.counts()
        return {"tiers": tiers, "manager": s}

