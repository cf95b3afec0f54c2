"""How long each connector hook holds vLLM's engine: histograms per hook and per step, and a warning line.

vLLM calls the connector's hooks on its engine thread; whatever they spend is added to every step. Each side
(the scheduler, each worker) times its hooks; a step's total above ``hook_warn_ms`` is logged (at most every
10 s, with how many steps did so). The figures go to vLLM's connector stats (the worker side, through
:class:`KvbmConnectorStats`), and, where ``KVBM_HOOK_TIMES_DIR`` is set, to ``<dir>/<side>-<pid>.json``
(written at most once a second, after a step whose load-path stages moved, and at shutdown) for benchmarks
and tests. The load path's stage counters (:mod:`kvbm.integrations.vllm.stages`: lookups, Onboards by tier, the
copy into the paged KV, tokens computed after a hit) go the same ways, under ``stages``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvbm.integrations.vllm.stages import Stages, diff, rates, stages_of

log = logging.getLogger("kvbm.vllm")

BOUNDS_MS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)  # then +Inf
WARN_EVERY_S = 10.0
DUMP_EVERY_S = 1.0


class Histogram:
    """Counts of observations per bucket of :data:`BOUNDS_MS`, with their count, sum and max."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(BOUNDS_MS) + 1)
        self.count, self.sum_ms, self.max_ms = 0, 0.0, 0.0

    def observe(self, ms: float) -> None:
        self.buckets[bisect.bisect_left(BOUNDS_MS, ms)] += 1
        self.count += 1
        self.sum_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "sum_ms": round(self.sum_ms, 3), "max_ms": round(self.max_ms, 3),
                "buckets": list(self.buckets)}


class HookTimes:
    """The hook and step histograms of one side of the connector, and its load-path stage counters."""

    def __init__(self, side: str, warn_ms: float, stages: Stages | None = None) -> None:
        self.side, self.warn_ms = side, warn_ms
        self.stages = stages if stages is not None else stages_of(side)
        self._interval_stages = self.stages.snapshot()  # the counters at the last take_interval
        self._dumped_version = -1
        self.hooks: dict[str, Histogram] = {}
        self._interval: dict[str, Histogram] = {}  # since the last take_interval (vLLM's stats interval)
        self._interval_slow = 0
        self.step = Histogram()
        # Each step's hook time less the synchronous loads' copies (:meth:`exclude`): what a step spent beyond moving
        # the bytes its forward needs.
        self.beyond_copies = Histogram()
        self._copies_in_step = 0.0
        self.slow_steps = 0
        self._in_step = 0.0
        self._slowest: tuple[float, str] = (0.0, "")
        self._warned_at = 0.0
        self._unwarned = 0
        self._dumped_at = 0.0
        out = os.environ.get("KVBM_HOOK_TIMES_DIR")
        self._dump_to = Path(out) / f"{side}-{os.getpid()}.json" if out else None

    @contextlib.contextmanager
    def time(self, hook: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            self.hooks.setdefault(hook, Histogram()).observe(ms)
            self._interval.setdefault(hook, Histogram()).observe(ms)
            self._in_step += ms
            if ms > self._slowest[0]:
                self._slowest = (ms, hook)

    def exclude(self, ms: float) -> None:
        """``ms`` of the current hook were a synchronous load's copy (counted in the step, not beyond copies)."""
        self._copies_in_step += ms

    def end_step(self) -> None:
        """The last hook of an engine step on this side has run: its total is one step's observation."""
        ms, self._in_step = self._in_step, 0.0
        copies, self._copies_in_step = self._copies_in_step, 0.0
        slowest, self._slowest = self._slowest, (0.0, "")
        self.step.observe(ms)
        self.beyond_copies.observe(max(0.0, ms - copies))
        now = time.monotonic()
        if ms > self.warn_ms:
            self.slow_steps += 1
            self._interval_slow += 1
            self._unwarned += 1
            if now - self._warned_at >= WARN_EVERY_S:
                log.warning("kvbm: the connector's %s hooks held an engine step %.1f ms (%s %.1f ms; %d steps over "
                            "%.0f ms since the last such line)", self.side, ms, slowest[1], slowest[0],
                            self._unwarned, self.warn_ms)
                self._warned_at, self._unwarned = now, 0
        if self._dump_to is not None and (now - self._dumped_at >= DUMP_EVERY_S
                                          or self.stages.version != self._dumped_version):
            self.dump()  # a load's stages are on disk once its step ends (a bench reads them per request)

    def snapshot(self) -> dict[str, Any]:
        return {"side": self.side, "bounds_ms": list(BOUNDS_MS), "warn_ms": self.warn_ms,
                "slow_steps": self.slow_steps, "step": self.step.to_dict(),
                "step_beyond_copies": self.beyond_copies.to_dict(),
                "hooks": {name: h.to_dict() for name, h in sorted(self.hooks.items())},
                "stages": self.stages.snapshot()}

    def take_interval(self) -> dict[str, Any]:
        """The hooks observed since the last call (what vLLM's connector stats aggregate), then forgotten."""
        hooks, self._interval = self._interval, {}
        slow, self._interval_slow = self._interval_slow, 0
        now = self.stages.snapshot()
        stages, self._interval_stages = diff(now, self._interval_stages), now
        if not hooks and not stages:
            return {}
        return {"slow_steps": slow, "hooks": {name: h.to_dict() for name, h in hooks.items()}, "stages": stages}

    def dump(self) -> None:
        if self._dump_to is None:
            return
        self._dumped_at = time.monotonic()
        self._dumped_version = self.stages.version
        tmp = self._dump_to.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(self._dump_to)


@dataclass
class KvbmConnectorStats(KVConnectorStats):
    """The worker side's hook times in vLLM's connector stats: ``data`` is :meth:`HookTimes.take_interval`, and an
    interval's figures reduce to each hook's max, the steps over the threshold and the load path's stages (mean
    Onboard ms, the copy's GB/s, blocks per tier)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not self.data:
            self.data = dict(other.data)
            return self
        mine, theirs = self.data.setdefault("hooks", {}), other.data.get("hooks", {})
        for name, h in theirs.items():
            cur = mine.get(name)
            mine[name] = h if cur is None else {
                "count": cur["count"] + h["count"], "sum_ms": cur["sum_ms"] + h["sum_ms"],
                "max_ms": max(cur["max_ms"], h["max_ms"]),
                "buckets": [a + b for a, b in zip(cur["buckets"], h["buckets"], strict=True)]}
        self.data["slow_steps"] = self.data.get("slow_steps", 0) + other.data.get("slow_steps", 0)
        st = self.data.setdefault("stages", {})
        for name, v in other.data.get("stages", {}).items():
            st[name] = st.get(name, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"kvbm slow steps": self.data.get("slow_steps", 0)}
        for name, h in self.data.get("hooks", {}).items():
            out[f"kvbm {name} max ms"] = round(h["max_ms"], 2)
        st = self.data.get("stages", {})
        for name, v in rates(st).items():
            out[f"kvbm {name.replace('_', ' ')}"] = v
        for name in ("copy_in_bytes", "onboard_blocks", "computed_after_hit_tokens"):
            if name in st:
                out[f"kvbm {name.replace('_', ' ')}"] = st[name]
        for name, v in st.items():
            if name.startswith("onboard_blocks_"):
                out[f"kvbm onboard blocks {name.rsplit('_', 1)[1]}"] = v
        return out

    def is_empty(self) -> bool:
        return not self.data.get("hooks") and not self.data.get("stages")
