"""``kvbm bench tiers``: throughput of every path the block manager moves bytes on, next to a raw baseline.

Each kvbm figure goes through :class:`~kvbm.manager.BlockManager` over tiers built by
:func:`kvbm.stack.build_stack` (``onboard`` for upward moves, ``offload(durable=True)`` for downward ones);
each baseline moves the same bytes in the same process with the plainest code that does the job:

==================  ========================================  ===========================================
path                kvbm                                      baseline
==================  ========================================  ===========================================
G2->G1, G1->G2      manager onboard / offload (memory mover)  numpy ``copyto`` per block (and torch copy_)
G2->G3              offload durable (DiskTier, fsync)         open + pwrite + fdatasync per file, 1 thread
G3->G2 cold/warm    onboard (page cache dropped / kept)       pread per file (fadvise DONTNEED / kept)
G2->G4 PUT          offload durable (S3Tier http|aio|nixl)    boto3 put_object, N threads
G4->G2 GET          onboard                                   boto3 get_object().read(), N threads
==================  ========================================  ===========================================

Repeats of kvbm and baseline are interleaved so drift hits both; the S3 rows run in rounds (every S3 path
once per round, then the LMCache peer's pass), so each path's i-th run sits next to the others' i-th run.
CPU is ``getrusage(RUSAGE_SELF)``
user+sys over the run (every thread of this process); the S3 server's CPU comes from ``/proc/<pid>/stat``
of the embedded SeaweedFS (its whole process group), when this bench started it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from kvbm.bench.common import MB, rnd_bytes
from kvbm.bench.paired import PairRunner
from kvbm.bench.runner import BenchRun
from kvbm.bench.tiers_local import disk_rows, memory_rows
from kvbm.bench.tiers_options import MiB, TiersOptions, namespace
from kvbm.bench.tiers_peer import LmcachePeer
from kvbm.bench.tiers_s3 import s3_rows
from kvbm.blocks import BlockKey

__all__ = ["TiersOptions", "run_tiers"]


async def run_tiers(opts: TiersOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the tier benchmark; returns the report (machine, options, paths, rows)."""
    n, size = opts.blocks, opts.block_bytes
    ns = namespace()
    keys = [BlockKey(ns, secrets.token_bytes(16)) for _ in range(n)]
    data = [rnd_bytes(size, i) for i in range(n)]
    nbytes = n * size
    paths: dict[str, Any] = {}
    with_s3 = "s3" in opts.groups
    bench = BenchRun("tiers", opts, echo, s3=with_s3, s3_domain=opts.peer_domain if opts.peer_python else None,
                     paths=paths)
    report = bench.report
    echo(f"kvbm bench tiers: {n} x {size / MiB:g} MiB blocks ({nbytes / MB:.0f} MB), median of {opts.repeats}")
    if with_s3:
        echo("  starting S3 endpoint ..." if not opts.s3_endpoint else f"  S3 endpoint {opts.s3_endpoint}")
    with bench:
        srv, work = bench.srv, bench.work
        server_pid: int | None = srv["pid"] if srv else None
        if srv is not None:
            paths["s3_endpoint"] = {"endpoint": srv["endpoint"], "embedded": srv["embedded"], "bucket": srv["bucket"],
                                    "prefix": srv["prefix"], "server_cpu_measured": bool(server_pid)}
        r = PairRunner(opts.repeats, nbytes, server_pid, echo)
        if "memory" in opts.groups:
            await memory_rows(opts, r, keys, data, work, paths)
        if "disk" in opts.groups:
            await disk_rows(opts, r, keys, data, work, paths)
        if srv is not None:
            peer = LmcachePeer(opts, srv, report, echo) if opts.peer_python else None
            try:
                if peer is not None:
                    await peer.start()
                await s3_rows(opts, r, keys, data, work, srv, paths, peer.after_round if peer else None)
                if peer is not None:
                    peer.rows(r, paths)
            finally:
                if peer is not None:
                    peer.close()
        report["rows"] = r.rows
    return report
