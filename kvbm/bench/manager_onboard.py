"""``kvbm bench manager``'s onboard overhead: a full onboard from G3 and from G4 against the tier's own reads of
the same blocks and a raw transfer of the same bytes."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbm.bench.common import MB, boto3_client, delete_prefix, median, rnd_bytes, s3_server
from kvbm.bench.manager_options import ManagerOptions, MiB, add_row, block_keys
from kvbm.config import Config


async def bench_onboard(opts: ManagerOptions, rows: list[dict[str, Any]], work: Path,
                        echo: Callable[[str], None]) -> dict[str, Any]:
    from kvbm.stack import build_stack

    n, size = opts.onboard_blocks, opts.block_bytes
    ns = f"kvbm-bench-{secrets.token_hex(8)}"
    keys = block_keys(n, ns)
    data = [rnd_bytes(size, i) for i in range(n)]
    nbytes = n * size
    out: dict[str, Any] = {}
    cap = (n + 1) * size
    with s3_server(work, endpoint=opts.s3_endpoint, access_key=opts.s3_access_key, secret_key=opts.s3_secret_key,
                   bucket=opts.s3_bucket) as srv:
        d: dict[str, Any] = {
            "block_bytes": size, "device": {"enabled": False}, "host": {"capacity": cap, "pin": True},
            "disk": {"dir": str(work / "g3"), "capacity": 3 * cap, "o_direct": True, "fsync": True},
            "s3": {"enabled": True, "endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": srv["prefix"],
                   "access_key": srv["access_key"], "secret_key": srv["secret_key"], "client": "aiobotocore",
                   "max_pending_writes": max(64, n)},
            "embedded_s3": {"enabled": False}, "transfer": {"backend": "auto"},
        }
        stack = await build_stack(msgspec.convert(d, Config), tiers=("G2", "G3", "G4"), index=False)
        mgr = stack.manager
        g3, g4 = mgr.by_name["G3"], mgr.by_name["G4"]
        cli = boto3_client(srv)
        pool = ThreadPoolExecutor(8)
        try:
            for k, a in zip(keys, data, strict=True):
                await mgr.put(k, memoryview(a), tier="G2", cascade=False)
            assert await mgr.offload(keys, durable=True) == n
            # Page-aligned and pre-faulted, like the G2 pool the onboard lands in (O_DIRECT reads go straight in).
            sink_map = mmap.mmap(-1, n * size)
            sink = np.frombuffer(sink_map, dtype=np.uint8).reshape(n, size)
            sink.fill(0)

            async def tier_reads(tier: Any) -> None:
                # The tier alone, at the manager's concurrency (all blocks gathered), into plain buffers.
                got = await asyncio.gather(*(tier.get_into(k, memoryview(sink[i])) for i, k in enumerate(keys)))
                assert all(g == size for g in got)

            def raw_g3() -> None:
                for i, k in enumerate(keys):
                    fd = os.open(g3.path_for(k), os.O_RDONLY)
                    try:
                        os.preadv(fd, [memoryview(sink[i])], 4096)
                    finally:
                        os.close(fd)

            def raw_g4() -> None:
                def one(i: int) -> None:
                    cli.get_object(Bucket=srv["bucket"], Key=g4.object_key(keys[i]))["Body"].read()

                list(pool.map(one, range(n)))

            async def cold() -> None:
                await asyncio.to_thread(lambda: [g3.drop_page_cache(k) for k in keys])

            for src, tier, raw, below in (("G3", g3, raw_g3, ["G2"]), ("G4", g4, raw_g4, ["G2", "G3"])):
                t_on, t_tier, t_raw = [], [], []
                for _ in range(opts.onboard_repeats):
                    await mgr.delete(keys, tiers=below)
                    await cold()
                    assert mgr.lookup(keys) == [src] * n
                    t = time.perf_counter()
                    got = await mgr.onboard(keys, to="G2")
                    t_on.append(time.perf_counter() - t)
                    assert got == n
                    await cold()
                    t = time.perf_counter()
                    await tier_reads(tier)
                    t_tier.append(time.perf_counter() - t)
                    await cold()
                    if src == "G3":  # the raw baseline reads kvbm's own files; make them cold for it too
                        await asyncio.to_thread(lambda: [g3.drop_page_cache(k) for k in keys])
                    t = time.perf_counter()
                    await asyncio.to_thread(raw)
                    t_raw.append(time.perf_counter() - t)
                on, ti, ra = median(t_on), median(t_tier), median(t_raw)
                rawname = "pread" if src == "G3" else "boto3 get x8"
                add_row(rows, f"onboard {n} x {size / MiB:g} MiB from {src}", "manager.onboard to G2", on * 1e3, "ms",
                        f"{nbytes / on / MB:.0f} MB/s")
                add_row(rows, f"onboard overhead vs {src} tier reads", "onboard - tier.get_into (same blocks)",
                        (on - ti) * 1e3, "ms", f"{(on - ti) / n * 1e3:.2f} ms/block; tier alone {ti * 1e3:.0f} ms")
                add_row(rows, f"onboard overhead vs raw {src} transfer", f"onboard - {rawname}", (on - ra) * 1e3, "ms",
                        f"{(on - ra) / n * 1e3:.2f} ms/block; raw {ra * 1e3:.0f} ms ({nbytes / ra / MB:.0f} MB/s)")
                out[src] = {"onboard_s": t_on, "tier_s": t_tier, "raw_s": t_raw}
                echo(f"  onboard from {src}: {on * 1e3:.0f} ms; tier reads {ti * 1e3:.0f} ms; raw {ra * 1e3:.0f} ms")
            await mgr.delete(keys)
        finally:
            pool.shutdown()
            cli.close()
            await stack.close()
            with contextlib.suppress(Exception):
                delete_prefix(srv, srv["prefix"])
    return out
