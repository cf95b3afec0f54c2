"""Deleting blocks from tiers (an admin Evict, a purge's notice) and keeping the registry true to what really went."""

from __future__ import annotations

from collections.abc import Sequence

from kvbm.blocks import BlockKey
from kvbm.errors import TierUnavailableError
from kvbm.manager.state import ManagerState


async def delete_copies(state: ManagerState, keys: Sequence[BlockKey], tiers: Sequence[str] | None = None, *,
                        gone: bool = False) -> int:
    """See :meth:`kvbm.manager.BlockManager.delete`."""
    by_tier: dict[str, list[BlockKey]] = {}
    for key in keys:
        for name in state.registry.where(key) if tiers is None else tiers:
            by_tier.setdefault(name, []).append(key)
    removed = 0
    failed: list[tuple[str, Exception]] = []
    for name, ks in by_tier.items():
        tier = state.by_name[name]
        try:
            await tier.delete_blocks(ks, gone=gone)
        except Exception as e:  # the other tiers still delete; raised below
            failed.append((name, e))
        removed += state.registry.remove_many(name, [k for k in ks if not tier.contains(k)])
    if failed:
        name, e = failed[0]
        if isinstance(e, TierUnavailableError):
            raise TierUnavailableError(f"{name} could not delete every block ({e}); {removed} copies removed, "
                                       "the rest stay indexed") from e
        raise e
    return removed
