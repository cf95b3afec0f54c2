"""``kvbm bench manager``: the manager's bookkeeping costs.

* **ingest**: block events (a block stored in a tier) per second: through the daemon's socket
  (PrepareStore + copy into G2 shared memory + CommitStore, batched: one ``store()`` per batch, and one
  ``store()`` of many blocks that the client pipelines in requests of a batch each) when :mod:`kvbm.daemon` exists,
  and straight into ``manager.registry`` in-process (``registry.add`` and ``registry.remove``).
* **lookup**: ``manager.lookup`` (``registry.match_prefix``) latency for a fully held 1,000-block prefix
  with 1M blocks registered (in-process), and the same request through the daemon's socket after the
  daemon was filled to the same count (medians of per-round percentiles).
* **index memory** per registered block: the heap the registry keeps once the caller's keys are dropped
  (tracemalloc, every block in one tier and in two), and the RSS delta of the registration.
* **onboard overhead**: a full onboard of N blocks from G3 and from G4 minus (a) the tier's own reads of
  the same blocks at the same concurrency and (b) a raw transfer of the same bytes (pread / boto3 GET).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbm.bench.manager_daemon import bench_daemon, daemon_available
from kvbm.bench.manager_onboard import bench_onboard
from kvbm.bench.manager_options import ManagerOptions
from kvbm.bench.manager_registry import bench_registry
from kvbm.bench.runner import BenchRun

__all__ = ["ManagerOptions", "run_manager"]


async def run_manager(opts: ManagerOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    has_daemon = daemon_available()
    use_daemon = opts.daemon != "off" and has_daemon and "daemon" in opts.groups
    # The onboard part starts its own S3 endpoint (it builds a stack over it): none here.
    bench = BenchRun("manager", opts, echo, s3=False, rows=rows, daemon={"available": has_daemon, "used": use_daemon})
    echo(f"kvbm bench manager: {opts.registered:,} blocks registered, {opts.prefix_blocks}-block prefix; daemon: "
         + ("socket" if use_daemon else "not used (kvbm.daemon missing)" if not has_daemon else "off"))
    if {"ingest", "lookup", "memory"} & set(opts.groups):
        bench_registry(opts, rows, echo)
    with bench:
        if use_daemon:
            bench_daemon(opts, rows, bench.work, echo)
        if "onboard" in opts.groups:
            bench.report["onboard"] = await bench_onboard(opts, rows, bench.work, echo)
    return bench.report
