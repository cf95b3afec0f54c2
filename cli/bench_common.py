"""What the ``kvbm bench`` commands share: option groups (S3, the random model), comma lists, running a bench
with its options checked, and writing its JSON and plot."""

from __future__ import annotations

import asyncio
from typing import Any

import click


def csv_list(value: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in value.split(",") if s.strip())


def emit(report: dict[str, Any], json_path: str | None, plot_path: str | None, plot: Any) -> None:
    from kvbm.bench.common import write_json

    if plot_path:
        try:
            plot(report, plot_path)
            report.setdefault("plots", []).append(plot_path)
            click.echo(f"plot: {plot_path}")
        except ImportError as e:
            click.echo(f"no plot ({e}); pip install 'kvbm[bench]'", err=True)
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")


def run_checked(opts: Any, run: Any, name: str) -> dict[str, Any]:
    """Check ``opts`` (a bad option is the CLI's usage error), run the bench (a bad input file it names is the
    CLI's error), and stamp the command line that ran it."""
    import sys

    try:
        opts.check()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        report = asyncio.run(run(opts, click.echo))
    except ValueError as e:  # e.g. a bad trace line, named with its field
        raise click.ClickException(str(e)) from None
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index(name):]] if name in sys.argv else sys.argv
    return report


def stack(*options: Any) -> Any:
    """One decorator of several click options, in the order given (the order ``--help`` lists them)."""

    def apply(fn: Any) -> Any:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


def s3_options(bucket: str = "kvbm-bench",
               bucket_help: str | None = "Bucket (objects go under a fresh prefix).") -> Any:
    """The S3 endpoint a bench runs against: ``--s3-endpoint`` (else a fresh SeaweedFS), its keys and bucket."""
    return stack(
        click.option("--s3-endpoint", default=None, help="Use this loopback S3 endpoint instead of a fresh SeaweedFS."),
        click.option("--s3-access-key", default="", envvar="AWS_ACCESS_KEY_ID", show_envvar=True),
        click.option("--s3-secret-key", default="", envvar="AWS_SECRET_ACCESS_KEY", show_envvar=True),
        click.option("--s3-bucket", default=bucket, show_default=True, help=bucket_help),
    )


with_s3 = s3_options()
DISK_HELP = "Where temp dirs go (a real disk)."
seed_option = click.option("--seed", default=0, show_default=True)


def workdir_option(help: str = DISK_HELP) -> Any:
    return click.option("--workdir", type=click.Path(file_okay=False), default=None, help=help)


def with_target(workdir_help: str = DISK_HELP) -> Any:
    """Where a bench runs (BenchTarget): ``--workdir`` and the S3 options."""
    return stack(workdir_option(workdir_help), with_s3)


def with_output(*, plot: str | None = None, json_help: str | None = None,
                markdown: str = "Print the table as markdown.") -> Any:
    """What a bench writes besides its table: ``--json``, ``--plot`` (when ``plot`` is its help), ``--markdown``."""
    opts = [click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=json_help)]
    if plot is not None:
        opts.append(click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help=plot))
    opts.append(click.option("--markdown", is_flag=True, help=markdown))
    return stack(*opts)


model_opts = [  # the random Llama of the benches that drive vLLM's OpenAI server (RandomModelOptions)
    click.option("--layers", default=8, show_default=True),
    click.option("--hidden", default=1024, show_default=True),
    click.option("--heads", default=8, show_default=True),
    click.option("--kv-heads", default=4, show_default=True),
    click.option("--vocab", default=8192, show_default=True),
    click.option("--dtype", default="auto", show_default=True,
                 type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
                 help="Weights and KV; auto: bfloat16 on a GPU or a CPU with AVX-512/AMX/Arm, float32 on an AVX2 "
                 "CPU (which emulates bf16 ~90x slower)."),
]
with_model = stack(*model_opts)
