"""A purge of blocks (an admin Evict, ``manager.purges.purge``): deleting them from tiers covers their write-throughs.

The index says which tiers hold a block, not which are being written: a write-through PUT to S3 under way when the
purge deletes would land after it and put the purged block back in the bucket. So a purge also

* **covers the moves in flight** into the purged tiers (:meth:`Moves.cover`): each deletes the copy it wrote once
  it lands, and the purge waits for them, at most ``PURGE_WAIT_S`` (a slow S3 never holds the Evict for long; one
  still under way then deletes its copy by itself when it lands);
* **deletes again** what landed while it was deleting (a move that finished before it was covered);
* **forgets what was owed** to the purged tiers (:meth:`OwedWrites.forget`), journaled, so no catch-up writes the
  block back, now or after a restart.

A cascade that starts after the purge finds no copy left to write from when the purge named every tier; one that
starts after a purge of only the lower tiers writes the block there again, as any later write-through would.

A purge that leaves some tier first lets the blocks' background write-throughs queued or under way land
(:meth:`Purges.settle`, bounded by ``PURGE_WAIT_S``): an Evict of G2 alone is "free the memory", and the write to the
disk it would otherwise cut short (its source deleted before it started) was the block's only way to a lower tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from kvbm.blocks import BlockKey
from kvbm.manager.deletes import delete_copies
from kvbm.manager.moves import Moves
from kvbm.manager.owed import OwedWrites
from kvbm.manager.state import ManagerState

PURGE_WAIT_S = 2.0  # the longest a purge waits for the moves it covered (a delayed S3 PUT, then its DELETE)


async def purge_copies(state: ManagerState, moves: Moves, owed: OwedWrites, keys: Sequence[BlockKey],
                       tiers: Sequence[str], *, gone: bool = False, wait_s: float = PURGE_WAIT_S) -> int:
    """Delete ``keys`` from ``tiers`` and undo their write-throughs into them (see the module); returns copies
    removed. ``gone``: another process already deleted them from disk/S3 (only the indexes are updated), though a
    copy written after that is deleted for real. Raises as :func:`delete_copies` does."""
    owed.forget(keys, tiers)  # a block owed there and not in flight now: neither held nor moving, still purged
    reg = state.registry
    held = [k for k in keys if any(reg.holds(t, k) for t in tiers)]
    try:
        removed = await delete_copies(state, held, tiers, gone=gone) if held else 0
    finally:  # after the delete (the moves that started while it ran are covered too), even one that failed
        covered = moves.cover(keys, tiers)
    if covered:
        await asyncio.wait(covered, timeout=wait_s)  # futures, not tasks: a timeout leaves the moves running
    # Written by a move that finished before it was covered (while the delete's I/O was under way): deleted now.
    landed = [k for k in keys if any(reg.holds(t, k) for t in tiers)]
    if landed:
        removed += await delete_copies(state, landed, [t for t in tiers if any(reg.holds(t, k) for k in landed)])
    return removed


class Purges:
    """The manager's purges: :func:`purge_copies` with its moves and owed writes."""

    def __init__(self, state: ManagerState, moves: Moves, owed: OwedWrites,
                 cascades: Callable[[Iterable[BlockKey]], dict[BlockKey, set[asyncio.Future[bool]]]],
                 catch_up: Callable[[Iterable[BlockKey]], int] = lambda _keys: 0) -> None:
        self.s = state
        self.moves = moves
        self.owed = owed
        self.cascades = cascades  # the write-throughs of some blocks, queued or under way
        self.catch_up = catch_up  # starts again the write-throughs of some blocks that were shed
        self.wait_s = PURGE_WAIT_S

    async def settle(self, keys: Sequence[BlockKey], tiers: Sequence[str], *, gone: bool = False) -> set[BlockKey]:
        """Before a purge of ``keys`` from ``tiers`` that leaves another tier: of those no tier it leaves holds yet,
        wait (at most ``wait_s``) for the write-throughs queued or under way (background, a durable store's, the
        owed drain's, and those shed in a burst, started again now), so the copies they make below are kept.
        Returns the keys the purge must skip, their only copies still on their way down: a write-through still
        under way after the wait, or a write owed to a tier it leaves (failed in an outage: the drain pays it once
        that tier is back). Not for ``gone`` (the blocks were deleted from the lower tiers already: a write-through
        now would only put them back)."""
        left = [t.name for t in self.s.tiers if t.name not in tiers]
        if gone or not left:
            return set()
        reg = self.s.registry
        alone = [k for k in keys if not any(reg.holds(t, k) for t in left)]
        self.catch_up(alone)  # a write-through shed in a burst: started now, waited for as the others
        pending = self.cascades(alone)
        if pending:
            await asyncio.wait({f for fs in pending.values() for f in fs}, timeout=self.wait_s)
        under_way = {k for k, fs in pending.items() if not all(f.done() for f in fs)}
        alone = [k for k in alone if not any(reg.holds(t, k) for t in left)]  # still: nothing landed below
        return under_way | self.owed.owed_to(alone, left)

    async def purge(self, keys: Sequence[BlockKey], tiers: Sequence[str] | None = None, *, gone: bool = False) -> int:
        """Delete ``keys`` from ``tiers`` (default all) and undo their write-throughs into them; copies removed."""
        names = [t.name for t in self.s.tiers] if tiers is None else list(tiers)
        return await purge_copies(self.s, self.moves, self.owed, keys, names, gone=gone)
