"""The load path stage by stage in ``kvbm bench serve``: the connector's stage counters and hook times (the files
``KVBM_HOOK_TIMES_DIR`` asks its processes for) read before and after a timed request or phase.

A request's row: the lookup (the scheduler's round trips, when the connector counts them), the pins (a synchronous
load's Onboards, on the scheduler's lookup thread), the Onboard wait (the worker's count, else the synchronous
load's hook time less its copy), the blocks per tier (the daemon's tier
hits), the copy into vLLM's paged KV (bytes, seconds, GB/s), the tokens vLLM computed after the hit, and TTFT.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

# Hook times whose sums a row uses: the scheduler's lookup waits and the worker's synchronous load.
HOOK_SUMS = {"get_num_new_matched_tokens": "scheduler_lookup_hook_ms", "start_load_kv": "load_hook_ms"}


def read_stages(root: Path) -> dict[str, dict[str, float]]:
    """Per side, the stage counters (and the sums of :data:`HOOK_SUMS`) of every process's file, added up."""
    out: dict[str, dict[str, float]] = {"scheduler": {}, "worker": {}}
    for f in sorted(root.glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            snap = json.loads(f.read_text())
            acc = out.setdefault(snap["side"], {})
            for name, v in snap.get("stages", {}).items():
                acc[name] = acc.get(name, 0) + v
            for hook, name in HOOK_SUMS.items():
                h = snap.get("hooks", {}).get(hook)
                if h:
                    acc[name] = acc.get(name, 0) + h["sum_ms"]
    return out


def delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {side: {k: round(v - before.get(side, {}).get(k, 0), 6) for k, v in c.items()
                   if v != before.get(side, {}).get(k, 0)} for side, c in after.items()}


def stage_row(d: dict[str, dict[str, float]], completion: dict[str, Any] | None, tier_hits: dict[str, int] | None,
              ) -> dict[str, Any]:
    """One request's (or phase's) stages from the counters' delta ``d`` and its completion(s)."""
    s, w = d.get("scheduler", {}), d.get("worker", {})
    copy_s = w.get("copy_in_s", 0.0)
    row: dict[str, Any] = {
        "lookups": s.get("lookups"),
        "lookup_ms": round(s["lookup_ms"] / s["lookups"], 3) if s.get("lookups") else None,
        "scheduler_lookup_hook_ms": s.get("scheduler_lookup_hook_ms"),
        # A sync load's blocks are pinned by the scheduler's lookup thread (its Onboards, off the step), an async
        # load's Onboarded by the worker's loader thread.
        "pins": s.get("pins"),
        "pin_ms": round(s["pin_ms"] / s["pins"], 3) if s.get("pins") else None,
        "onboards": w.get("onboards"),
        "onboard_ms": w.get("onboard_ms"),
        "load_hook_ms": w.get("load_hook_ms"),
        "onboard_blocks_by_tier": {k.rsplit("_", 1)[1]: v for k, v in w.items() if k.startswith("onboard_blocks_")}
        or None,
        "tier_hits": tier_hits,
        "copy_in_bytes": int(w.get("copy_in_bytes", 0)),
        "copy_in_vblocks": int(w.get("copy_in_vblocks", 0)),
        "copy_in_ms": round(copy_s * 1e3, 3),
        "copy_in_gbps": round(w["copy_in_bytes"] / copy_s / 1e9, 3) if copy_s else None,
    }
    if row["onboard_ms"] is None and row["load_hook_ms"] is not None:
        # A synchronous load's hook is its copies and, past the pin window, its Onboards: the rest of it.
        row["onboard_ms_derived"] = round(row["load_hook_ms"] - row["copy_in_ms"], 3)
    if completion is not None:
        row["ttft_ms"] = round(completion["ttft_s"] * 1e3, 1) if completion.get("ttft_s") is not None else None
        row["prompt_tokens"] = completion["prompt_tokens"]
        row["cached_tokens"] = completion["cached_tokens"]
        row["computed_after_hit_tokens"] = completion["prompt_tokens"] - (completion["cached_tokens"] or 0)
    return row
