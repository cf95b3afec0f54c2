"""``kvbm bench trace | trace-serve``: the shipped Mooncake trace (or another) replayed through a daemon, and a
slice of it through vLLM's OpenAI server."""

from __future__ import annotations

from typing import Any

import click

from kvbm.bench.trace_sim import SHIPPED_TRACE
from kvbm.cli.bench_common import csv_list, emit, run_checked, seed_option, with_model, with_output, with_target
from kvbm.cli.common import SIZE


@click.command("trace")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, exists=True), default=str(SHIPPED_TRACE),
              show_default="the shipped Mooncake conversation trace",
              help="A Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids), .gz or not.")
@click.option("--limit", default=0, show_default=True, help="Replay only the first N requests (0: all).")
@click.option("--speedup", default=20.0, show_default=True, help="Timestamps are divided by this.")
@click.option("--block-size", type=SIZE, default="32KiB", show_default=True, help="Bytes per trace block (a hash_id).")
@click.option("--capacities", default="0.01,0.03", show_default=True,
              help="G2+G3 capacity as shares of the trace's distinct blocks, comma separated.")
@click.option("--g2-share", default=0.25, show_default=True, help="G2's part of G2+G3.")
@click.option("--s3", "s3_modes", default="off", show_default=True, help="off, on or off,on (G4 behind G2+G3).")
@click.option("--inflight", default=8, show_default=True, help="Requests in flight at most.")
@click.option("--eviction", "evictions", default="lru", show_default=True,
              help="The daemon's policy.eviction: lru, frequency or lru,frequency (a run each).")
@click.option("--g3-dir", default="", help="Where G3 lives (e.g. a tmpfs: the policy without the disk's latency).")
@seed_option
@with_target()
@with_output(plot="PNG: hit ratio vs capacity, per tier, with LRU / policy / Belady.")
def trace_cmd(trace_path: str, limit: int, speedup: float, block_size: int, capacities: str, g2_share: float,
              s3_modes: str, inflight: int, evictions: str, g3_dir: str, seed: int, workdir: str | None,
              s3_endpoint: str | None,
              s3_access_key: str, s3_secret_key: str, s3_bucket: str, json_path: str | None, plot_path: str | None,
              markdown: bool) -> None:
    """Replay a production trace through a real daemon: hit ratio per tier vs LRU / Belady / infinite."""

    from kvbm.bench.trace import TraceOptions, plot_trace, run_trace, trace_table

    try:
        caps = tuple(float(x) for x in csv_list(capacities))
    except ValueError:
        raise click.BadParameter(f"numbers, not {capacities!r}", param_hint="--capacities") from None
    opts = TraceOptions(trace=trace_path, limit=limit, speedup=speedup,
                        block_bytes=block_size, capacities=caps, g2_share=g2_share,
                        s3_modes=csv_list(s3_modes), inflight=inflight, evictions=csv_list(evictions), g3_dir=g3_dir,
                        seed=seed, workdir=workdir,
                        s3_endpoint=s3_endpoint, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key,
                        s3_bucket=s3_bucket)
    report = run_checked(opts, run_trace, "trace")
    click.echo("")
    click.echo(trace_table(report, markdown))
    emit(report, json_path, plot_path, plot_trace)


@click.command("trace-serve")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, exists=True), default=str(SHIPPED_TRACE),
              show_default="the shipped Mooncake conversation trace", help="A Mooncake-format JSONL trace, .gz or not.")
@click.option("--conversations", default=12, show_default=True, help="Conversations (2+ turns) in the slice.")
@click.option("--turns", default=4, show_default=True, help="Requests kept per conversation.")
@click.option("--max-blocks", default=48, show_default=True, help="Hash ids kept per request (its prefix).")
@click.option("--tokens-per-id", default=64, show_default=True,
              help="Tokens per hash id: one vLLM block (a multiple of 32).")
@click.option("--speedup", default=200.0, show_default=True, help="Timestamps are divided by this.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at most.")
@click.option("--max-tokens", default=8, show_default=True, help="Output tokens per request (greedy).")
@click.option("--sources", default="vllm,kvbm", show_default=True, help="vllm (alone), kvbm (vLLM + kvbm).")
@click.option("--g1-share", default=0.25, show_default=True,
              help="vLLM's KV space, as a share of the slice's distinct tokens.")
@click.option("--g2-share", default=0.25, show_default=True, help="G2, as a share of the slice's distinct blocks.")
@click.option("--s3/--no-s3", default=True, show_default=True, help="G4 (S3) behind G2 and G3.")
@with_model
@seed_option
@with_target()
@with_output()
def trace_serve_cmd(trace_path: str, sources: str, json_path: str | None, markdown: bool, **kw: Any) -> None:
    """A conversation slice of a trace through vLLM's OpenAI server: vLLM alone vs vLLM + kvbm."""

    from kvbm.bench.openai_server import native_dtype
    from kvbm.bench.trace_serve import TraceServeOptions, run_trace_serve, trace_serve_table

    if kw["dtype"] == "auto":
        kw["dtype"] = native_dtype()
    opts = TraceServeOptions(trace=trace_path, sources=csv_list(sources), **kw)
    report = run_checked(opts, run_trace_serve, "trace-serve")
    click.echo("")
    click.echo(trace_serve_table(report, markdown))
    emit(report, json_path, None, None)


COMMANDS = [trace_cmd, trace_serve_cmd]
