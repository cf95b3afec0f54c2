"""Paired daemon figures: ``kvbm bench manager --groups daemon`` (ingest through the socket, lookups) run with
each checkout's code in turn, alternated, N rounds; per row the median of each checkout and the ratio to the first.

    git worktree add --detach /tmp/base main   # (and its kvbm/cli, kvbm/tiers links, as in the main checkout)
    .venv/bin/python scripts/daemon_paired.py --checkout base=/tmp/base --checkout this=. --pairs 5 \\
        --json results/out.json -- --registered 20000 --daemon-events 20000 --daemon-lookups 300 --repeats 1

Each run is a fresh process (``python -m kvbm.cli.main`` with PYTHONPATH on the checkout), so the client and the
daemon are both that checkout's. The order alternates per round (A B, B A, ...) so a drift in the machine's load
does not favour one side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_once(path: str, bench_args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        cmd = [sys.executable, "-m", "kvbm.cli.main", "bench", "manager", "--groups", "daemon", *bench_args,
               "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        rows = json.loads(out.read_text())["rows"]
    got = {f"{r['metric']} | {r['via'].split(' (')[0]} {_shape(r['via'])} ({r['unit']})": r["value"] for r in rows}
    for r in rows:  # the daemon's CPU per event, from the ingest rows' notes: less sensitive to waiting for a core
        if m := re.search(r"daemon CPU ([0-9.]+) us/event", r.get("note", "")):
            got[f"daemon CPU per event | {_shape(r['via'])} (us)"] = float(m.group(1))
    return got


def _shape(via: str) -> str:
    """The row's batch shape without its block count (which differs with --registered)."""
    return via[via.find("("):] if "store" in via else ""


def _commit(path: str) -> str:
    """The checkout's commit, with ``+`` when its tracked files differ from it."""
    git = ["git", "-C", path]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"]).returncode != 0
    return head + ("+" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", required=True, help="name=path; the first is the base")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", required=True)
    ap.add_argument("bench_args", nargs="*")
    a = ap.parse_args()
    sides = [tuple(c.split("=", 1)) for c in a.checkout]
    res: dict[str, list[dict[str, float]]] = {n: [] for n, _ in sides}
    loads = [os.getloadavg()[0]]
    for i in range(a.pairs):
        for name, path in sides if i % 2 == 0 else sides[::-1]:
            res[name].append(run_once(path, a.bench_args))
            loads.append(os.getloadavg()[0])
            print(f"round {i} {name}: " + ", ".join(f"{v:,.0f}" for v in res[name][-1].values()), flush=True)
    base = sides[0][0]
    table: dict[str, dict[str, Any]] = {}
    for k in res[base][0]:
        row: dict[str, Any] = {n: statistics.median(r[k] for r in res[n]) for n, _ in sides}
        row["runs"] = {n: [round(r[k], 1) for r in res[n]] for n, _ in sides}
        for n, _ in sides[1:]:
            row[f"{n}/{base}"] = row[n] / row[base]
        table[k] = row
        print(k + ": " + ", ".join(f"{n} {row[n]:,.1f}" for n, _ in sides) + "; "
              + ", ".join(f"{n}/{base} {row[f'{n}/{base}']:.3f}" for n, _ in sides[1:]))
    Path(a.json).write_text(json.dumps({
        "command": " ".join(sys.argv), "pairs": a.pairs,
        "checkouts": {n: {"path": p, "commit": _commit(p)} for n, p in sides},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_averages": [round(x, 2) for x in loads], "date": time.strftime("%Y-%m-%d %H:%M"), "rows": table,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
