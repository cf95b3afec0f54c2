"""The daemon's event loop while an access-log compaction and a merge of the logs run (real SeaweedFS).

47 logs of ``--hashes`` lines each are put under one node's prefix; an :class:`AccessRecorder` flush then
compacts them (the 48th log triggers it) and :func:`read_access_times` merges them, while a 5 ms ticker on the
same loop records how late it wakes. Prints one JSON line (the largest stall, the 99th percentile).

    python scripts/bench_access_log_lag.py --hashes 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvbm.blocks import BlockKey
from kvbm.config import S3Config
from kvbm.fleet import recency
from kvbm.s3server import EmbeddedS3
from kvbm.tiers.s3 import make_s3_tier

NS = "lagbench-0123456789abcdef"


async def run(srv: EmbeddedS3, n: int) -> dict[str, object]:
    t = make_s3_tier(S3Config(bucket=srv.bucket, prefix="lag"), srv.endpoint, (srv.access_key, srv.secret_key))
    await t.start()
    try:
        for i in range(47):
            body = recency.encode_log(os.urandom(16) for _ in range(n))
            await t.put_aux(recency.log_key("lag", NS, "node-a", 1_000_000 + i), body)
        rec = recency.AccessRecorder(t, "node-a", 1, clock=lambda: 2_000_000.0, compact_at=48)
        rec.record([BlockKey(NS, os.urandom(16))])
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        t0 = time.perf_counter()
        await rec.flush()
        flush_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        times, _logs = await recency.read_access_times(t, [NS])
        read_s = time.perf_counter() - t1
        done.set()
        await ticker
        gaps.sort()
        return {"lines": 47 * n, "compacted": rec.compacted, "blocks": len(times), "flush_s": round(flush_s, 2),
                "read_s": round(read_s, 2), "max_loop_stall_s": round(gaps[-1], 3),
                "p99_loop_stall_s": round(gaps[int(len(gaps) * 0.99)], 3)}
    finally:
        await t.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hashes", type=int, default=20_000, help="lines per log")
    ap.add_argument("--weed", default=str(Path(sys.executable).parent / "weed"))
    args = ap.parse_args()
    srv = EmbeddedS3(Path(tempfile.mkdtemp(prefix="kvbm-lagbench-")) / "sw", weed=args.weed, bucket="kvbm-lag",
                     stop_timeout_s=2.0, reuse=False)
    srv.start()
    try:
        print(json.dumps(asyncio.run(run(srv, args.hashes))))
    finally:
        srv.stop(force=True)


if __name__ == "__main__":
    main()
