"""The bucket scopes already reconciled with the disk (a namespace, or None for the whole bucket): each is
reconciled once, at its first listing (:meth:`BlockManager.index_tier`). Bounded: fresh namespaces are free to
mint, so at most :data:`MAX_RECONCILED` are remembered, the oldest forgotten first (listed again later, it is
reconciled again: what the bucket lacks then is owed again, which is what a reconcile is for)."""

from __future__ import annotations

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
