"""The operator's requests (``kvbm purge``, ``kvbm status --reindex``): Evict and Reindex change what the index
holds; :mod:`kvbm.daemon.auth` lets only admin sessions make them."""

from __future__ import annotations

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.daemon.sessions import WorkerSession
from kvbm.daemon.transport import Handled
from kvbm.errors import TierUnavailableError
from kvbm.manager.core import PERSISTENT, BlockManager


class AdminHandlers:
    """Evict (a purge told to the daemon) and Reindex (a tier listed again), on the manager only."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    async def evict(self, msg: p.Evict, _w: WorkerSession) -> p.Evicted:
        names = [t.name for t in self.manager.tiers]
        tiers = msg.tiers or names
        bad = [t for t in tiers if t not in names]
        if bad:
            raise Handled(p.E_BAD_REQUEST, f"unknown tiers {bad}; have {names}")
        reg = self.manager.registry
        if msg.hashes is not None:
            keys = [BlockKey(msg.namespace, h) for h in msg.hashes]
        else:
            seen: dict[BlockKey, None] = {}
            for t in tiers:
                seen.update((k, None) for k in reg.keys(t) if k.namespace == msg.namespace)
            seen.update((k, None) for k in self.manager.moves.moving(tiers, msg.namespace))
            keys = list(seen)
        # The write-throughs below land first; a block whose write-through is still under way is skipped.
        writing = await self.manager.purges.settle(keys, tiers, gone=msg.gone)
        free = [k for k in keys if not reg.is_pinned(k) and k not in writing]
        # A purge, not a plain delete: the blocks' write-throughs in flight into these tiers are undone too.
        removed = await self.manager.purges.purge(free, tiers, gone=msg.gone)
        return p.Evicted(removed=removed, skipped=len(keys) - len(free))

    async def reindex(self, msg: p.Reindex, _w: WorkerSession) -> p.Reindexed:
        names = msg.tiers or [t.name for t in self.manager.tiers if t.kind in PERSISTENT]
        unknown = [n for n in names if n not in self.manager.by_name]
        if unknown:
            raise Handled(p.E_BAD_REQUEST, f"no tier {unknown[0]!r} here")
        reg = self.manager.registry
        blocks = added = 0
        for name in names:
            before = reg.count(name)
            try:
                blocks += await self.manager.index_tier(name, msg.namespace or None, refresh=True)
            except TierUnavailableError as e:
                raise Handled(p.E_UNAVAILABLE, f"{name} cannot be listed now: {e}") from e
            added += reg.count(name) - before
        return p.Reindexed(blocks=blocks, added=added)
