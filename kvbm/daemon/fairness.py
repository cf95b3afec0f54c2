"""Fair starts: which admitted request's handler starts next, so one client's backlog does not sit in front of
another client's request (issue 37).

asyncio runs ready tasks first-come-first-served: before this, every request read was started at once, and a
tenant with 16 requests in flight put 16 handlers (and their replies' sends) in front of each request of a
tenant with one. Now each client (:meth:`kvbm.daemon.service.Service.client_of`: a tenant, a session, a
connection) starts at most ``burst`` handlers per event-loop turn; the rest wait in that client's own queue, and
the queues are served round-robin, ``burst`` each, at the next turns. A client with nothing queued starts its
request the turn it is read, behind at most ``burst`` starts of each other client.

Nothing is refused or dropped here: a queued request is already admitted (counted in flight against its
client's cap), so the caps and their ``busy`` answers are unchanged; a queue only delays, by a turn per
``burst`` requests ahead of it in that client's queue. Concurrency is not capped (a handler that awaits I/O, a
Barrier waiting for its peers, leaves room for the next start), so nothing can wait on a start that never comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvbm.daemon")


class FairStarts:
    """Per-client start budgets per loop turn, and the queues of the requests past them."""

    def __init__(self, burst: int) -> None:
        self.burst = max(1, burst)
        self._started: dict[object, int] = {}  # starts since the last turn began, per client
        self._queues: dict[object, deque[Callable[[], object]]] = {}  # clients with requests waiting, in turn order
        self._turn_pending = False  # _next_turn is scheduled

    @property
    def queued(self) -> int:
        """Admitted requests waiting for their start."""
        return sum(len(q) for q in self._queues.values())

    def start(self, client: object, begin: Callable[[], object]) -> bool:
        """Call ``begin`` (which starts the handler) now if ``client`` has budget left this turn and nothing
        queued (True), else queue it behind the client's other requests (False)."""
        queue = self._queues.get(client)
        if queue is None and self._started.get(client, 0) < self.burst:
            self._started[client] = self._started.get(client, 0) + 1
            self._schedule()
            begin()
            return True
        if queue is None:
            queue = self._queues[client] = deque()
        queue.append(begin)
        self._schedule()
        return False

    def _schedule(self) -> None:
        # One call per turn with starts: the budgets reset when the loop comes round again.
        if not self._turn_pending:
            self._turn_pending = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """A new turn: budgets reset, and the queued clients start ``burst`` each, one at a time round-robin."""
        self._turn_pending = False
        self._started.clear()
        if not self._queues:
            return
        starts: list[Callable[[], object]] = []
        for _ in range(self.burst):
            for client in list(self._queues):
                queue = self._queues[client]
                starts.append(queue.popleft())
                self._started[client] = self._started.get(client, 0) + 1
                if not queue:
                    del self._queues[client]
            if not self._queues:
                break
        # The client served first this turn goes last next turn (its queue, if any, is re-added at the end).
        for client in list(self._queues)[:1]:
            self._queues[client] = self._queues.pop(client)
        self._schedule()
        for begin in starts:
            try:
                begin()
            except Exception:  # one request's start must not lose the others'
                log.exception("start failed")
