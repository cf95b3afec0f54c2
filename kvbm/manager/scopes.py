"""The bucket scopes already reconciled with the disk (a namespace, or None for the whole bucket): each is
reconciled once, at its first listing (:meth:`BlockManager.index_tier`). Bounded: fresh namespaces are free to
mint, so at most :data:`MAX_RECONCILED` are remembered, the oldest forgotten first (listed again later, it is
reconciled again: what the bucket lacks then is owed again, which is what a reconcile is for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbm.manager.owed import OwedWrites
    from kvbm.manager.state import ManagerState

MAX_RECONCILED = 4096


class Reconciled:
    """Scopes reconciled so far; ``first(scope)`` says whether one is new (and remembers it)."""

    def __init__(self) -> None:
        self._seen: dict[str | None, None] = {}  # oldest first

    def first(self, namespace: str | None) -> bool:
        if None in self._seen or namespace in self._seen:
            return False
        self._seen[namespace] = None
        while len(self._seen) > MAX_RECONCILED:
            del self._seen[next(iter(self._seen))]
        return True

    def __len__(self) -> int:
        return len(self._seen)


async def reconcile_once(state: ManagerState, reconciled: Reconciled, owed: OwedWrites, name: str,
                         namespace: str | None) -> int:
    """Reconcile shared tier ``name``'s first listing of ``namespace`` with each disk above it (what the disk holds
    and the listing lacks is owed to it, :meth:`OwedWrites.reconcile`); blocks owed."""
    if state.by_name[name].kind != "s3" or not reconciled.first(namespace):
        return 0
    n = 0
    for tier in state.tiers:
        if tier.name == name:
            break
        if tier.local_dir is not None:
            n += await owed.reconcile(tier.name, name, namespace)
    return n
