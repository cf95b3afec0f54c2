"""``kvbm bench copy``: the connector's copy between G2 slots and vLLM's paged KV (CPU torch) against a memcpy."""

from __future__ import annotations

import sys

import click


@click.command("copy")
@click.option("--layers", default=8, show_default=True)
@click.option("--kv-heads", default=4, show_default=True)
@click.option("--head-size", default=64, show_default=True)
@click.option("--block-size", default=128, show_default=True, help="Tokens per vLLM block.")
@click.option("--k", "k", default=2, show_default=True, help="vLLM blocks per kvbm block.")
@click.option("--blocks", default=16, show_default=True, help="kvbm blocks copied per repeat.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--repeats", default=7, show_default=True)
@click.option("--threads", default=0, show_default=True, help="torch intra-op threads (0: torch's default).")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def copy_cmd(json_path: str | None, **kw: int | str) -> None:
    """PagedCache.copy of N kvbm blocks into a vLLM-shaped paged KV (and back) against torch copy_ of the same
    bytes as one contiguous tensor; GB/s medians, block ids in runs and scattered."""
    from kvbm.bench.common import write_json
    from kvbm.bench.copy import CopyBenchOptions, copy_table, run_copy

    opts = CopyBenchOptions(**kw)  # type: ignore[arg-type]
    try:
        opts.check()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    report = run_copy(opts)
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("copy"):]] if "copy" in sys.argv else sys.argv
    click.echo(copy_table(report))
    click.echo("goals: " + str(report["goals"]))
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")


COMMANDS = [copy_cmd]
