"""One peer read's transfer on the asking side (:mod:`kvbm.daemon.peer_reads`): NIXL READs of the peer's pinned
slots into this daemon's own G2 slots, a part at a time, each part checksummed while the next one is read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from kvbm.daemon.peer_sums import slot_checksum
from kvbm.fleet import p2p as m
from kvbm.tiers.pool import SlotPoolTier

# A read goes in parts of this many bytes, each checksummed while the next is read: the asker's checksum (about
# a fifth of a read's time on one core) hides behind the READ but for the last part.
PART_BYTES = 32 << 20


class Fetcher:
    """Runs reads' transfers (each in the caller's thread) and their checksums (on a verify thread of its own);
    counts the threads in NIXL now, which a close waits for before the agent and G2 go."""

    def __init__(self) -> None:
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="kvbm-p2p-verify")
        self._lock = threading.Lock()
        self._busy = 0

    @property
    def busy(self) -> int:
        return self._busy

    def fetch(self, agent: Any, remote_name: str, remote: m.Connected, g2: SlotPoolTier, mine: list[tuple[int, int]],
              pinned: m.Pinned, deadline: float, started: list[bool]) -> tuple[set[int], float, float]:
        """READ ``mine`` ((index in the pin, own slot) pairs) from the peer's slots into ``g2``, a part of about
        ``PART_BYTES`` at a time, each part checksummed on the verify thread while the next one is read; returns
        the indexes whose bytes match the peer's checksums, the seconds in READs and those verifying after the last
        READ. Appends to ``started`` before posting its first READ; posts none once the pin's ``deadline`` passed.
        A thread: it blocks. Every part it started hashing is done when it returns or raises."""
        checks: list[Future[set[int]]] = []
        t1 = time.monotonic()
        with self._lock:
            self._busy += 1
        try:
            for part in parts(mine, pinned.nbytes, PART_BYTES):
                if time.monotonic() >= deadline:  # the peer's pin has ended: its slots may hold other blocks now
                    raise OSError(f"the peer's pin ended before the read ({len(checks)} parts read)")
                started.append(True)
                pairs = [(agent.pool_addr + s * g2.slot_bytes, remote.pool_addr + pinned.slots[i] * remote.slot_bytes,
                          pinned.nbytes[i]) for i, s in part]
                agent.read(remote_name, pairs, max(0.05, deadline - time.monotonic()))
                checks.append(self._verifier.submit(_verify, g2, part, pinned))
            t2 = time.monotonic()
            good: set[int] = set()
            for c in checks:
                good |= c.result()
            return good, t2 - t1, time.monotonic() - t2
        finally:
            futures_wait(checks)
            with self._lock:
                self._busy -= 1

    def shutdown(self) -> None:
        self._verifier.shutdown(wait=False)


def _verify(g2: SlotPoolTier, part: list[tuple[int, int]], pinned: m.Pinned) -> set[int]:
    """The indexes of ``part`` ((index in the pin, own slot) pairs) whose bytes match the peer's xxh3-64."""
    return {i for i, s in part if slot_checksum(g2, s, pinned.nbytes[i]) == pinned.checksums[i]}


def parts(mine: list[tuple[int, int]], nbytes: Sequence[int], size: int) -> Iterator[list[tuple[int, int]]]:
    """``mine`` in consecutive runs of about ``size`` bytes (at least one block each)."""
    part: list[tuple[int, int]] = []
    got = 0
    for item in mine:
        part.append(item)
        got += nbytes[item[0]]
        if got >= size:
            yield part
            part, got = [], 0
    if part:
        yield part
