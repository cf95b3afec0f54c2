"""``kvbm bench manager``'s in-process part: ingest, prefix lookups and the index's memory per block, straight on
:class:`kvbm.index.registry.Registry`."""

from __future__ import annotations

import gc
import os
import secrets
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from kvbm.bench.common import median, summary
from kvbm.bench.manager_options import TIERS, ManagerOptions, MiB, add_row, block_keys
from kvbm.blocks import BlockKey
from kvbm.index.registry import Registry


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _index_bytes_per_block(keys: list[BlockKey], tiers: list[str]) -> float:
    """Heap the registry keeps per block once the caller's keys are gone (tracemalloc).

    Each block is added from a fresh :class:`BlockKey` over a copy of its hash, as a daemon decodes it from a
    message, and the caller's objects are dropped before the heap is read: what remains is the index."""
    gc.collect()
    tracemalloc.start()
    try:
        reg = Registry(TIERS)
        base, _ = tracemalloc.get_traced_memory()
        for k in keys:
            fresh = BlockKey(k.namespace, bytes(bytearray(k.hash)))
            for t in tiers:
                reg.add(t, fresh, 8 * MiB)
        del fresh
        gc.collect()
        cur, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reg.count(tiers[0]) == len(keys) == len(reg)
    return (cur - base) / len(keys)


def bench_registry(opts: ManagerOptions, rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    """Ingest/remove rates, index memory and lookup latency of the manager's registry, in-process."""
    ns = f"kvbm-bench-{secrets.token_hex(8)}"
    n = opts.registered
    reps = max(1, opts.onboard_repeats)
    keys = block_keys(n, ns)
    if "memory" in opts.groups:
        one = _index_bytes_per_block(keys, ["G3"])
        two = _index_bytes_per_block(keys, ["G2", "G3"])
        add_row(rows, "index memory per block", "tracemalloc, one tier", one, "bytes",
                f"{n:,} blocks in G3; heap the registry keeps once the caller's keys are dropped")
        add_row(rows, "index memory per block", "tracemalloc, two tiers", two, "bytes",
                f"{n:,} blocks each in G2 and G3 (per block, not per entry)")
        echo(f"  index memory: {one:.0f} B/block in one tier, {two:.0f} B/block in two (tracemalloc)")
    gc.collect()
    reg = Registry(TIERS)
    add_s, rm_s = [], []
    gc.collect()
    rss0 = _rss()
    for r in range(reps):
        t0 = time.perf_counter()
        for k in keys:
            reg.add("G3", k, 8 * MiB)
        add_s.append(time.perf_counter() - t0)
        if r == 0:
            rss1 = _rss()  # the first fill: later ones reuse the dict the removes left behind
        if r == reps - 1:
            break
        t0 = time.perf_counter()
        for k in keys:
            reg.remove("G3", k)
        rm_s.append(time.perf_counter() - t0)
    if "ingest" in opts.groups:
        dt = median(add_s)
        add_row(rows, "block events ingested", "registry.add in-process", n / dt, "events/s",
                f"{n:,} BlockStored events into one tier, one thread; median of {len(add_s)}")
        msg = f"  registry.add: {n / dt:,.0f} events/s"
        if rm_s:
            add_row(rows, "block events removed", "registry.remove in-process", n / median(rm_s), "events/s",
                    f"{n:,} BlockRemoved events, one thread; median of {len(rm_s)}")
            msg += f"; registry.remove: {n / median(rm_s):,.0f} events/s"
        echo(msg)
    if "memory" in opts.groups:
        # The keys exist before rss0: the delta is the index alone (allocator slack included).
        add_row(rows, "index memory per block", "RSS delta", (rss1 - rss0) / n, "bytes", f"{n:,} blocks in G3")
        echo(f"  index memory: {(rss1 - rss0) / n:.0f} B/block (RSS delta)")
    if "lookup" in opts.groups:
        from kvbm.manager.core import BlockManager

        # A manager over no real tiers would refuse nothing: lookup only reads the registry.
        mgr = BlockManager([])
        mgr.registry = reg
        prefixes = [keys[i : i + opts.prefix_blocks] for i in range(0, min(n, 50 * opts.prefix_blocks),
                                                                     opts.prefix_blocks)]
        prefixes = [p for p in prefixes if len(p) == opts.prefix_blocks] or [keys[: opts.prefix_blocks]]
        p50s, p99s = [], []
        for _ in range(reps):
            lat = []
            for i in range(opts.lookups):
                p = prefixes[i % len(prefixes)]
                t = time.perf_counter()
                got = mgr.lookup(p)
                lat.append(time.perf_counter() - t)
                assert len(got) == len(p)
            s = summary([x * 1e6 for x in lat])
            p50s.append(s["p50"])
            p99s.append(s["p99"])
        via = f"manager.lookup in-process ({n:,} registered)"
        rounds = f"median of {reps} rounds of {opts.lookups}"
        add_row(rows, f"lookup {opts.prefix_blocks}-block prefix p50", via, median(p50s), "us", rounds)
        add_row(rows, f"lookup {opts.prefix_blocks}-block prefix p99", via, median(p99s), "us",
                f"{rounds}; held in G3 (G1, G2 empty)")
        echo(f"  lookup in-process: p50 {median(p50s):.0f} us, p99 {median(p99s):.0f} us")
    del reg, keys
    gc.collect()

