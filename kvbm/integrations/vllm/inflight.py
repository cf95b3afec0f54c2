"""Saves this engine planned and may not have stored yet: a next turn that arrives at once waits for them.

A finished request's last blocks (those completed in its last steps, its partial block) are saved after vLLM
freed them: staged at the engine's next step and stored off its thread (kvbm.integrations.vllm.staging). A
conversation's next turn that arrives at once (a chat client, an agent's next call, an RL rollout's next
``generate``) is looked up in that very step, before those saves ran: it missed its own history's last blocks
and computed them. The scheduler keeps the keys it planned to save for ``wait_s``; an answer that stops right
before one of them is not final. The request is asked again (vLLM skips it this step; the engine and every other
request go on) until the answer covers that key or the request has waited ``wait_s``, then it is computed from
where the answer ends: a save that failed costs at most ``wait_s`` of that request's time, never a step's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kvbm.integrations.vllm.metadata import BlockTransfer


class SavesInFlight:
    """The keys of saves planned less than ``wait_s`` ago, and the requests waiting for one of them."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._until: dict[bytes, float] = {}  # key -> until when its save may still be in flight (monotonic)
        self._order: deque[tuple[float, bytes]] = deque()  # the same, oldest first: pruned from the left
        self._waiting: dict[str, float] = {}  # requests asked again for a key in flight -> since when
        self.waited = 0  # requests that waited for a save (once each)
        self.gave_up = 0  # ... and were computed after wait_s without it

    def planned(self, transfers: Iterable[BlockTransfer]) -> None:
        """Saves planned now (full and partial blocks' keys)."""
        if self.wait_s <= 0:
            return
        now = time.monotonic()
        until = now + self.wait_s
        for tr in transfers:
            for key in tr.hashes:
                self._until[key] = until
                self._order.append((until, key))
        while self._order and self._order[0][0] <= now:
            t, key = self._order.popleft()
            if self._until.get(key) == t:
                del self._until[key]

    def hold(self, req_id: str, hashes: list[bytes], vhashes: list[bytes], k: int, next_block: bytes,
             matched: int, partial: int, from_next: bool) -> bool:
        """Whether the answer (``matched`` full blocks, then ``partial`` vLLM blocks) of ``req_id``'s lookup
        (:meth:`kvbm.integrations.vllm.scheduler.SchedulerSide._wanted`) stops right before a key in flight and
        the request should be asked again; False once it has waited ``wait_s`` (it is computed from there)."""
        if not self._until:
            self._waiting.pop(req_id, None)
            return False
        nxt = hashes[matched : matched + 1]  # the next full block
        if k > 1 and not from_next:  # a longer partial block after the full ones, or the next block's head
            nxt += vhashes[matched * k + partial : matched * k + k - 1]
            if next_block and matched == len(hashes):
                nxt.append(next_block)
        now = time.monotonic()
        if not any(self._until.get(key, 0.0) > now for key in nxt):
            self._waiting.pop(req_id, None)
            return False
        since = self._waiting.setdefault(req_id, now)
        if since == now:
            self.waited += 1
        if now - since < self.wait_s:
            return True
        self._waiting.pop(req_id, None)
        self.gave_up += 1
        return False

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)

    def clear(self) -> None:
        """A new weights epoch: the saves in flight are the old weights' (dropped, never stored under it)."""
        self._until.clear()
        self._order.clear()
        self._waiting.clear()
