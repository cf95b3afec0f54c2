"""``kvbm``: one click group for every command."""

from __future__ import annotations

import logging
import os

import click

from kvbm.cli.bench import bench
from kvbm.cli.common import CliState, group_config_option
from kvbm.cli.config_cmd import config
from kvbm.cli.demo import demo
from kvbm.cli.keys import keys
from kvbm.cli.plan import plan_cmd
from kvbm.cli.prewarm import prewarm
from kvbm.cli.purge import purge
from kvbm.cli.s3 import s3
from kvbm.cli.serve import serve
from kvbm.cli.status import status


@click.group()
@click.version_option(package_name="kvbm")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@group_config_option
@click.pass_context
def main(ctx: click.Context, verbose: int, config_path: str | None) -> None:
    """kvbm: tiered KV-cache block manager (G1 GPU -> G2 host -> G3 disk -> G4 S3).

    The config (--config here or on the command) is read once, when a command first needs it.
    """
    ctx.obj = CliState(config_path)
    level = os.environ.get("KVBM_LOG_LEVEL") or ("DEBUG" if verbose > 1 else "INFO" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


main.add_command(demo)
main.add_command(bench)
main.add_command(status)
main.add_command(purge)
main.add_command(prewarm)
main.add_command(serve)
main.add_command(s3)
main.add_command(config)
main.add_command(plan_cmd)
main.add_command(keys)

if __name__ == "__main__":
    main()
