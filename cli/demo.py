"""``kvbm demo``: the whole tier stack end to end on the embedded default, with timings."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import click
import numpy as np

from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import prefix_hashes
from kvbm.blocks.layout import KVLayout
from kvbm.cli.common import CliState, config_option, one_line_errors, pass_state
from kvbm.config.schema import human_bytes


async def run_demo(cfg: Any, blocks: int, keep: bool, echo: Any = print) -> dict[str, Any]:
    from kvbm.stack import build_stack

    t0 = time.perf_counter()
    stack = await build_stack(cfg)
    mgr = stack.manager
    try:
        echo(f"stack ready in {time.perf_counter() - t0:.1f}s: "
             + ", ".join(f"{t.name}={t.kind}" for t in mgr.tiers))
        # A Llama-3.1-8B-shaped shard (128 KiB/token in bf16): 64 tokens per 8 MiB block.
        layout = KVLayout(model="kvbm-demo/llama-3.1-8b-shape", num_layers=32, num_kv_heads=8, head_size=128,
                          dtype="bfloat16", block_bytes=cfg.block_nbytes)
        rng = np.random.default_rng(secrets.randbits(32))
        partial = (layout.block_tokens - 1) // 2  # a trailing partial block, which is never stored
        tokens = rng.integers(0, 128_000, size=blocks * layout.block_tokens + partial)
        keys = [BlockKey(layout.namespace, h) for h in prefix_hashes(tokens, layout.block_tokens)]
        data = {k: rng.integers(0, 256, size=layout.block_nbytes, dtype=np.uint8) for k in keys}
        nbytes = layout.block_nbytes * len(keys)
        echo(f"{len(keys)} blocks x {human_bytes(layout.block_nbytes)} = {human_bytes(nbytes)} "
             f"({layout.block_tokens} tokens/block, {len(tokens)} tokens; the partial block is not stored)")

        t = time.perf_counter()
        for k in keys:
            await mgr.put(k, memoryview(data[k]))
        durable = await mgr.offload(keys, durable=True)
        store_s = time.perf_counter() - t
        echo(f"stored + written through to every tier in {store_s:.2f}s; durable blocks: {durable}/{len(keys)}")

        rows = []
        names = [t.name for t in mgr.tiers]
        for i, name in enumerate(names):
            above = names[:i]
            await mgr.delete(keys, tiers=above)  # onboard from this tier only
            if mgr.lookup(keys) != [name] * len(keys):
                rows.append({"source": name, "blocks": 0, "seconds": 0.0, "MBps": 0.0, "exact": False})
                continue
            t = time.perf_counter()
            n = await mgr.onboard(keys, to=names[0])
            dt = time.perf_counter() - t
            target = mgr.by_name[names[0]]
            exact = n == len(keys)
            for k in keys:
                exact = exact and (await target.get(k)) == data[k].tobytes()
            rows.append({"source": name, "blocks": n, "seconds": round(dt, 4),
                         "MBps": round(nbytes / dt / 1e6, 1) if dt else 0.0, "exact": exact})
        echo("")
        echo(f"{'onboard from':<14}{'blocks':>8}{'seconds':>10}{'MB/s':>10}  bytes exact")
        for i, r in enumerate(rows):
            # The first tier is the target itself: its blocks are already there, nothing moves.
            src = f"{r['source']} (resident)" if i == 0 else r["source"]
            rate = "-" if i == 0 else f"{r['MBps']:.1f}"
            echo(f"{src:<14}{r['blocks']:>8}{r['seconds']:>10.3f}{rate:>10}  {r['exact']}")
        report = {"blocks": len(keys), "block_bytes": layout.block_nbytes, "store_seconds": round(store_s, 3),
                  "onboard": rows, "stack": stack.describe()}
        echo("")
        echo("transfer paths: " + json.dumps(report["stack"]["transfer"]))
        if not keep:
            await mgr.delete(keys)
        return report
    finally:
        await stack.close()


@click.command()
@config_option
@click.option("--blocks", default=16, show_default=True, help="Blocks to store and onboard.")
@click.option("--keep", is_flag=True, help="Leave the demo blocks in the tiers afterwards.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON here.")
@one_line_errors
@pass_state
def demo(state: CliState, blocks: int, keep: bool, json_path: str | None) -> None:
    """Store a synthetic long prompt's KV blocks and onboard them back from G1, G2, G3 and G4.

    Uses the embedded default (a local SeaweedFS that kvbm starts on 127.0.0.1, a disk tier under
    ~/.cache/kvbm) unless --config or KVBM_* variables say otherwise. Every onboarded block is
    compared byte for byte with what was stored.
    """
    if blocks < 1:
        raise click.BadParameter("must be >= 1", param_hint="--blocks")
    cfg = state.config
    report = asyncio.run(run_demo(cfg, blocks, keep, click.echo))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if not all(r["exact"] for r in report["onboard"]):
        raise click.ClickException("some onboarded blocks did not match what was stored")
