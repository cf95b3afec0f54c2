"""kvbm.daemon.fairness: per-client start budgets per loop turn, the rest started round-robin in later turns."""

from __future__ import annotations

import asyncio

from kvbm.daemon.fairness import FairStarts


def test_a_backlog_starts_a_burst_per_turn_and_another_client_starts_at_once() -> None:
    async def main() -> tuple[list[str], list[bool]]:
        fair, started, now = FairStarts(2), [], []
        for i in range(6):
            now.append(fair.start("b", lambda i=i: started.append(f"b{i}")))
        now.append(fair.start("a", lambda: started.append("a0")))  # a's first request: its budget is untouched
        for _ in range(5):
            await asyncio.sleep(0)
        return started, now

    started, now = asyncio.run(main())
    assert now == [True, True, False, False, False, False, True]
    assert started == ["b0", "b1", "a0", "b2", "b3", "b4", "b5"]  # nothing lost, each client's order kept


def test_queued_clients_share_each_turn_round_robin() -> None:
    async def main() -> list[str]:
        fair, started = FairStarts(1), []
        for c in "bc":
            for i in range(3):
                fair.start(c, lambda c=c, i=i: started.append(f"{c}{i}"))
        for _ in range(4):
            await asyncio.sleep(0)
        return started

    # One of each per turn; the client served first in a turn goes last in the next.
    assert asyncio.run(main()) == ["b0", "c0", "b1", "c1", "c2", "b2"]
