"""A Mooncake-format trace (one JSON object a line: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``) and the hit ratios of caches replayed over it, computed from the trace alone.

A request's hit is its longest cached prefix of ``hash_ids`` (prefix caching: a block is of no use without its
parents). Hit ratio = hit blocks / all block references. Simulated caches, each of a capacity in blocks:

* ``lru``: every block of a request is touched head first (hit or stored);
* ``belady``: the offline optimum per block: on a miss the block whose next reference is farthest leaves, and
  a block referenced later than every cached one (or never again) is not admitted;
* ``infinite``: every block once seen stays (the bound of any cache);
* ``policy``: :class:`kvbm.manager.placement.PlacementPolicy`, the policy the daemon runs, on the same trace.
"""

from __future__ import annotations

import gzip
import heapq
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbm.manager import policy_sim
from kvbm.manager.placement import DEFAULT_WEIGHTS
from kvbm.manager.policy_sim import prefix_hit

# The conversation workload of the Mooncake FAST'25 trace release, gzipped (data/README.md: source, licence, figures).
SHIPPED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake-conversation.jsonl.gz"


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int = 0) -> list[TraceRequest]:
    """Parse a Mooncake-format JSONL trace, gzipped when its name ends in ``.gz`` (first ``limit`` requests when
    > 0), sorted by timestamp.

    A line that is not an object with an integer ``timestamp`` and a list of integer ``hash_ids`` raises
    ValueError naming the line and the field."""
    out: list[TraceRequest] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: not a JSON object")
            ts, ids = obj.get("timestamp"), obj.get("hash_ids")
            if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
                raise ValueError(f"{path}:{n}: timestamp: a number of ms >= 0 is required, got {ts!r}")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError(f"{path}:{n}: hash_ids: a list of integers is required")
            out.append(TraceRequest(int(ts), int(obj.get("input_length") or 0), int(obj.get("output_length") or 0),
                                    tuple(ids)))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def trace_summary(reqs: Sequence[TraceRequest]) -> dict[str, Any]:
    refs = sum(len(r.hash_ids) for r in reqs)
    distinct = len({h for r in reqs for h in r.hash_ids})
    return {"requests": len(reqs), "block_refs": refs, "distinct_blocks": distinct,
            "duration_s": (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1e3 if reqs else 0.0}


def lru_hits(reqs: Iterable[TraceRequest], capacity: int) -> int:
    return policy_sim.lru_hits((r.hash_ids for r in reqs), capacity)


def infinite_hits(reqs: Iterable[TraceRequest]) -> int:
    seen: set[int] = set()
    hits = 0
    for r in reqs:
        hits += prefix_hit(r.hash_ids, seen)
        seen.update(r.hash_ids)
    return hits


def _next_uses(reqs: Sequence[TraceRequest]) -> list[list[int]]:
    """Per request and block: the index of the next request that references the same block (inf: never)."""
    nxt: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in reqs]
    never = len(reqs) + 1
    for i in range(len(reqs) - 1, -1, -1):
        ids = reqs[i].hash_ids
        out[i] = [nxt.get(h, never) for h in ids]
        for h in ids:
            nxt[h] = i
    return out


def belady_hits(reqs: Sequence[TraceRequest], capacity: int, next_uses: list[list[int]] | None = None) -> int:
    nu = next_uses if next_uses is not None else _next_uses(reqs)
    never = len(reqs) + 1
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    for i, r in enumerate(reqs):
        hits += prefix_hit(r.hash_ids, cache)
        for h, n in zip(r.hash_ids, nu[i], strict=True):
            if h in cache:
                cache[h] = n
                heapq.heappush(heap, (-n, h))
                continue
            if n >= never:
                continue  # never referenced again: not admitted
            if len(cache) >= capacity:
                while heap and cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                far = -heap[0][0]
                if far <= n:
                    continue  # every cached block is needed sooner than this one
                del cache[heapq.heappop(heap)[1]]
            cache[h] = n
            heapq.heappush(heap, (-n, h))
        # Blocks of this request whose next use is the past cannot be; every entry's n > i by construction.
    return hits


def policy_hits(reqs: Sequence[TraceRequest], capacity: int, **kw: Any) -> int:
    """The daemon's placement policy (:mod:`kvbm.manager.placement`) as a cache of ``capacity`` blocks."""
    return policy_sim.simulate([r.hash_ids for r in reqs], capacity, times=[r.timestamp_ms / 1e3 for r in reqs], **kw)


def bounds(reqs: Sequence[TraceRequest], capacities: Sequence[int], with_policy: bool = True) -> dict[str, Any]:
    """Hit ratios (hit blocks / block references) of LRU, Belady, infinite (and the policy) per capacity."""
    refs = sum(len(r.hash_ids) for r in reqs) or 1
    nu = _next_uses(reqs)
    out: dict[str, Any] = {"infinite": round(infinite_hits(reqs) / refs, 4), "by_capacity": []}
    for c in capacities:
        row = {"capacity_blocks": int(c), "lru": round(lru_hits(reqs, c) / refs, 4),
               "belady": round(belady_hits(reqs, c, nu) / refs, 4)}
        if with_policy:
            row["policy"] = round(policy_hits(reqs, c) / refs, 4)
        out["by_capacity"].append(row)
    return out


def purge_cost(reqs: Sequence[TraceRequest], keep_share: float = 0.1, at: float = 0.5,
               age0_s: float = 600.0) -> dict[str, Any]:
    """What a purge of the bucket (an infinite cache: G4) to ``keep_share`` of its blocks, at fraction ``at`` of the
    trace, costs in hit ratio over the rest of the trace, by ranking: none (no purge), ``access`` (least recently
    used first, ``kvbm purge --max-bytes --by access``), ``value`` (the policy's hit density from what the bucket's
    access logs tell, hit since written or not, then age: ``--by value``) and ``value_counts`` (the same density
    with the reference counts a daemon keeps)."""
    split = int(len(reqs) * at)
    first, rest = reqs[:split], reqs[split:]
    last: dict[int, float] = {}
    written: dict[int, float] = {}
    counts: dict[int, int] = {}
    for r in first:
        t = r.timestamp_ms / 1e3
        for h in r.hash_ids:
            written.setdefault(h, t)
            last[h] = t
            counts[h] = counts.get(h, 0) + 1
    now = first[-1].timestamp_ms / 1e3 if first else 0.0
    keep_n = max(1, int(len(last) * keep_share))
    w = DEFAULT_WEIGHTS

    def density(h: int, n: int) -> float:
        return w[min(n, len(w)) - 1] / (now - last[h] + age0_s)

    ranked = {
        "none": set(last),
        "access": set(sorted(last, key=lambda h: last[h])[-keep_n:]),
        "value": set(sorted(last, key=lambda h: density(h, 2 if last[h] > written[h] else 1))[-keep_n:]),
        "value_counts": set(sorted(last, key=lambda h: density(h, counts[h]))[-keep_n:]),
    }
    refs = sum(len(r.hash_ids) for r in rest) or 1
    out: dict[str, Any] = {"purge_at_request": split, "bucket_blocks": len(last), "kept_blocks": keep_n,
                           "second_half_refs": refs}
    for name, kept in ranked.items():
        held = set(kept)
        hits = 0
        for r in rest:
            hits += prefix_hit(r.hash_ids, held)
            held.update(r.hash_ids)
        out[name] = round(hits / refs, 4)
    return out
