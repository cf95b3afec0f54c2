"""The load path's stages as counters that only grow: lookups, Onboards (by tier), the copy into vLLM's paged KV,
and the tokens computed after a hit. A benchmark or vLLM's connector stats take differences of them.

Counter names (a stage missing from a snapshot did not run on that side):

- ``lookups``, ``lookup_ms``: the scheduler's lookup round trips to the daemon (every rank), and their time;
- ``pins``, ``pin_ms``: the scheduler's Onboards of synchronous loads' hits (every rank, before the request is
  scheduled), and their time; ``pinned_blocks``: the worker's blocks copied out of slots so pinned;
- ``onboards``, ``onboard_ms``, ``onboard_blocks``, ``onboard_blocks_<tier>``: the worker's Onboard requests,
  the time waited for their replies, the kvbm blocks they brought and which tier each came from;
- ``copy_in_bytes``, ``copy_in_s``, ``copy_in_vblocks`` (and ``copy_out_*``): the copies from G2 slots into
  vLLM's paged KV (and back, for saves), in bytes, seconds and vLLM blocks;
- ``hit_tokens``, ``computed_after_hit_tokens``: per loaded request, the tokens kvbm supplied and those vLLM
  computed after them.

One object per process and side (:func:`stages_of`): vLLM runs each worker in a process of its own, and where the
scheduler shares the worker's process (a one-process CPU engine) the sides keep their own counters.
"""

from __future__ import annotations

import threading

_BY_SIDE: dict[str, Stages] = {}
_LOCK = threading.Lock()


class Stages:
    """Named counters, added to from any thread (the loader's and the engine's)."""

    def __init__(self) -> None:
        self._c: dict[str, float] = {}
        self._lock = threading.Lock()
        self.version = 0  # bumped on every add: a dump is due when it moved

    def add(self, **counters: float) -> None:
        with self._lock:
            for name, v in counters.items():
                self._c[name] = self._c.get(name, 0) + v
            self.version += 1

    def onboarded(self, ms: float, tiers: list[str]) -> None:
        """One Onboard reply waited ``ms`` for, its blocks from ``tiers`` (one name per block)."""
        by_tier: dict[str, float] = {}
        for t in tiers:
            by_tier[f"onboard_blocks_{t}"] = by_tier.get(f"onboard_blocks_{t}", 0) + 1
        self.add(onboards=1, onboard_ms=ms, onboard_blocks=len(tiers), **by_tier)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(self._c.items())}


def stages_of(side: str) -> Stages:
    """This process's counters for ``side`` (``scheduler`` or ``worker``)."""
    with _LOCK:
        return _BY_SIDE.setdefault(side, Stages())


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The counters of an interval: ``after`` minus ``before`` (a counter new in ``after`` counts whole)."""
    return {k: round(v - before.get(k, 0), 6) for k, v in after.items() if v != before.get(k, 0)}


def rates(c: dict[str, float]) -> dict[str, float]:
    """What a reader wants from counters: mean lookup and Onboard ms, the copy's GB/s (None: no such stage)."""
    out: dict[str, float] = {}
    if c.get("lookups"):
        out["lookup_ms_mean"] = round(c["lookup_ms"] / c["lookups"], 3)
    if c.get("onboards"):
        out["onboard_ms_mean"] = round(c["onboard_ms"] / c["onboards"], 3)
    for d in ("in", "out"):
        if c.get(f"copy_{d}_s"):
            out[f"copy_{d}_gbps"] = round(c[f"copy_{d}_bytes"] / c[f"copy_{d}_s"] / 1e9, 3)
    return out
