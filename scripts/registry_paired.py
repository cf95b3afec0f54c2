"""Paired registry figures: ``kvbm bench manager``'s in-process ingest/remove/lookup rows (and ``victims`` on a full
tier with no partial blocks) with another checkout's Registry vs this one's, alternated in one process, medians.

    git archive main kvbm tiers cli | tar -x -C /tmp/base
    .venv/bin/python scripts/registry_paired.py /tmp/base/kvbm/index/registry.py results/out.json
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from typing import Any

import kvbm.bench.manager_registry as mr
from kvbm.bench.manager_options import ManagerOptions, block_keys
from kvbm.index import registry as this


def victims_us(mod: Any, rounds: int = 20000) -> float:
    reg = mod.Registry(["G2", "G3"])
    reg.add_many("G2", block_keys(4096, "ns-0123456789abcdef"), 1)
    t = time.perf_counter()
    for _ in range(rounds):
        reg.victims("G2", 4, 4096)
    return (time.perf_counter() - t) / rounds * 1e6


def main(base_path: str, out: str, pairs: int = 3) -> None:
    spec = importlib.util.spec_from_file_location("base_registry", base_path)
    assert spec is not None and spec.loader is not None
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    opts = ManagerOptions(registered=200_000, lookups=500, onboard_repeats=3, groups=("ingest", "lookup"))
    res: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    for _ in range(pairs):
        for name, mod in (("base", base), ("this", this)):
            mr.Registry = mod.Registry  # type: ignore[attr-defined,misc]
            rows: list[dict[str, Any]] = []
            mr.bench_registry(opts, rows, lambda _s: None)
            d = {f"{r['metric']} | {r['via']} ({r['unit']})": r["value"] for r in rows}
            d["victims, 4 of 4096 blocks (us)"] = victims_us(mod)
            res[name].append(d)
    table = {}
    for k in res["base"][0]:
        b, n = (statistics.median(x[k] for x in res[s]) for s in ("base", "this"))
        table[k] = {"base": b, "this": n, "this/base": n / b}
        print(f"{k}: base {b:,.2f} this {n:,.2f} ratio {n / b:.3f}")
    with open(out, "w") as f:
        json.dump({"pairs": pairs, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
