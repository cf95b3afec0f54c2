"""Write-throughs owed after an outage: a tier that could not take a cascade (S3 down or shedding) is owed
the block, and the cascade is scheduled again once the tier takes writes, so a block stored during an outage
still ends up durable."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvbm.blocks import BlockKey
from kvbm.manager_state import ManagerState

CATCH_UP_EVERY_S = 2.0  # how often owed write-throughs check whether their tier takes writes again


class OwedWrites:
    """Tier -> keys owed; a loop runs while any are owed. ``schedule`` starts a cascade (False: queue full)."""

    def __init__(self, state: ManagerState, schedule: Callable[[BlockKey], bool]) -> None:
        self.s = state
        self.schedule = schedule
        self.every_s = CATCH_UP_EVERY_S
        self._owed: dict[str, set[BlockKey]] = {}
        self._task: asyncio.Task[None] | None = None

    def owe(self, tier: str, key: BlockKey) -> None:
        self._owed.setdefault(tier, set()).add(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def counts(self) -> dict[str, int]:
        """Blocks per tier whose write-through is waiting for that tier to take writes again."""
        return {t: len(keys) for t, keys in self._owed.items() if keys}

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        """While write-throughs are owed: every ``every_s``, cascade those whose tier is writable again."""
        while any(self._owed.values()):
            await asyncio.sleep(self.every_s)
            for name in [n for n, keys in self._owed.items() if keys]:
                if self.s.by_name[name].writable():
                    self.catch_up(name)

    def catch_up(self, tier: str) -> int:
        """Schedule the owed write-throughs to ``tier`` for blocks still held above it; returns how many."""
        keys, self._owed[tier] = self._owed.get(tier, set()), set()
        started = 0
        for key in keys:
            if self.s.registry.where(key) and not self.s.registry.holds(tier, key):
                if self.schedule(key):
                    started += 1
                else:
                    self._owed[tier].add(key)  # the cascade queue is full: next round
        return started
