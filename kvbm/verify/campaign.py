"""A campaign: many seeds, one engine at a time, and one report of what ran and what broke."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvbm.verify.harness import INVARIANTS, MODELS, run_seed, write_model


def run_campaign(seeds: Iterable[int], root: Path, *, faults: bool = True, models: tuple[str, ...] = MODELS,
                 echo: Callable[[str], None] = print, deadline_s: float | None = None) -> dict[str, Any]:
    """Run and check every seed (stopping early once ``deadline_s`` seconds have passed), the i-th on
    ``models[i % len(models)]``; the report: schedules run (by model), operations by kind (planned, and done: an
    abort_loading finds a loading request or not), blocks checked, violations by invariant with their seeds and
    models, and each seed's figures."""
    t0 = time.monotonic()
    paths = {m: write_model(root, m) for m in models}
    by_model: dict[str, int] = {}
    per_seed: list[dict[str, Any]] = []
    planned: dict[str, int] = {}
    done: dict[str, int] = {}
    by_invariant: dict[str, list[dict[str, Any]]] = {name: [] for name in INVARIANTS}
    totals = {"blocks_checked": 0, "blocks_stored": 0, "blocks_expected": 0, "hit_requests": 0,
              "control_requests": 0, "control_mismatches": 0, "preemptions": 0, "steps": 0}
    explained: dict[str, int] = {}
    hook_max = noise = 0.0
    sync_max = {"sync_load_max_ms": 0.0, "sync_save_max_ms": 0.0}  # those hooks, copies included
    harness_errors: list[dict[str, Any]] = []  # seeds the harness could not run (its own parts failed, twice)
    for i, seed in enumerate(seeds):
        family = models[i % len(models)]
        if deadline_s is not None and time.monotonic() - t0 > deadline_s:
            echo(f"deadline: stopped before seed {seed}")
            break
        s0 = time.monotonic()
        rep = run_seed(seed, root, paths[family], faults=faults, family=family)
        rep["wall_s"] = round(time.monotonic() - s0, 1)
        if "harness_error" in rep:
            harness_errors.append({"seed": seed, "model": family, "detail": rep["harness_error"][-1500:]})
            echo(f"seed {seed} ({family}): harness error, not run: {rep['harness_error'][-300:]}")
            continue
        by_model[family] = by_model.get(family, 0) + 1
        per_seed.append(rep)
        for k, n in rep["ops"].items():
            planned[k] = planned.get(k, 0) + n
        for ev in rep.get("events", []):
            done[ev["op"]] = done.get(ev["op"], 0) + 1
        for v in rep["violations"]:
            by_invariant.setdefault(v["invariant"], []).append({**v, "model": family})
        c = rep["counts"]
        for k in totals:
            totals[k] += rep.get(k) or c.get(k) or 0
        for k, n in c["blocks_missing_explained"].items():
            explained[k] = explained.get(k, 0) + n
        hook_max = max(hook_max, c.get("hook_step_max_ms", 0.0))
        sync_max = {k: max(sync_max[k], c.get(k, 0.0)) for k in sync_max}
        noise = max(noise, c.get("max_error_within_tolerance", 0.0))
        bad = sorted({v["invariant"] for v in rep["violations"]})
        echo(f"seed {seed} ({family}): {rep['wall_s']}s, {c['blocks_checked']} blocks checked, {rep['preemptions']} "
             f"preemptions, {c['hit_requests']} requests after a kvbm hit, violations: {', '.join(bad) or 'none'}")
    share = totals["blocks_stored"] / totals["blocks_expected"] if totals["blocks_expected"] else None
    return {
        "schedules": len(per_seed), "schedules_by_model": by_model, "seeds": [r["seed"] for r in per_seed],
        "faults": faults, "harness_errors": harness_errors,
        "wall_s": round(time.monotonic() - t0, 1), "machine": {"cpu": platform.processor() or platform.machine()},
        "operations_planned": planned, "operations_done": done, **totals,
        "blocks_stored_share": None if share is None else round(share, 4), "blocks_missing_explained": explained,
        "hook_step_max_ms_beyond_sync_loads": hook_max, **sync_max, "block_error_noise_floor": noise,
        "violations": {name: {"count": len(vs), "seeds": sorted({v["seed"] for v in vs}),
                              "models": sorted({v.get("model", "") for v in vs}), "first": vs[:20]}
                       for name, vs in by_invariant.items()},
        "per_seed": [{k: v for k, v in r.items() if k != "events"} for r in per_seed],
    }
