"""``kvbm bench``: throughput and latency benchmarks (tiers, manager, long-doc-qa, fleet, serve, trace, native).

Each subcommand prints a table, writes JSON with ``--json PATH`` (machine description, options and
every figure) and draws a PNG with ``--plot PATH``. Runs use temp dirs, a dedicated bucket prefix on
a loopback S3 endpoint (a fresh embedded SeaweedFS unless ``--s3-endpoint`` names one) and clean up.
"""

from __future__ import annotations

import importlib
import logging
import os

import click

# The modules whose COMMANDS make up ``kvbm bench``, one line each, sorted (a new bench is a new cli/bench_*.py
# module and its line here).
COMMAND_MODULES = (
    "kvbm.cli.bench_chaos",
    "kvbm.cli.bench_copy",
    "kvbm.cli.bench_p2p",
    "kvbm.cli.bench_serving",
    "kvbm.cli.bench_storage",
    "kvbm.cli.bench_trace",
    "kvbm.cli.bench_verify",
)


@click.group()
def bench() -> None:
    """Benchmarks of kvbm's data paths (not tests: they measure this machine)."""
    logging.getLogger("kvbm").setLevel(logging.WARNING)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's python API logs every agent at INFO
    logging.getLogger("nixl").setLevel(logging.WARNING)


for _name in COMMAND_MODULES:
    for _cmd in importlib.import_module(_name).COMMANDS:
        bench.add_command(_cmd)
