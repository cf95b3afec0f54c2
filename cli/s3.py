"""``kvbm s3``: the embedded SeaweedFS that the default config uses as G4."""

from __future__ import annotations

import json

import click

from kvbm.cli.common import CliState, config_option, one_line_errors, pass_state
from kvbm.config import Config, default_cache_dir


def _dir(cfg: Config) -> str:
    return cfg.embedded_s3.dir or str(default_cache_dir() / "seaweedfs")


@click.group("s3")
def s3() -> None:
    """The embedded S3 server (SeaweedFS on 127.0.0.1) behind the default config.

    `kvbm serve`, `kvbm demo` and the maintenance commands start it on demand and leave it running as a
    background service (so the bucket outlives them); these commands manage it by hand.
    """


@s3.command()
@config_option
@one_line_errors
@pass_state
def start(state: CliState) -> None:
    """Start the embedded server (or find the one already running) and print its endpoint."""
    from kvbm.stack import start_embedded_s3

    srv = start_embedded_s3(state.config)
    click.echo(json.dumps({"status": "reused" if srv.reused else "started", "endpoint": srv.endpoint,
                           "pid": srv.pid, "bucket": srv.bucket, "dir": str(srv.dir)}))


@s3.command()
@config_option
@click.option("--timeout", default=30.0, show_default=True, help="Seconds before SIGKILL.")
@one_line_errors
@pass_state
def stop(state: CliState, timeout: float) -> None:
    """Stop the embedded server (its data stays in its directory)."""
    from kvbm.s3server import stop_dir

    was = stop_dir(_dir(state.config), stop_timeout_s=timeout)
    click.echo("stopped" if was else "not running")


@s3.command()
@config_option
@one_line_errors
@pass_state
def status(state: CliState) -> None:
    """Whether the embedded server runs, where, and with which pid (exit 3 when it does not)."""
    from kvbm.s3server import EmbeddedS3

    st = EmbeddedS3(_dir(state.config)).status()
    click.echo(json.dumps(st))
    if not st.get("running"):
        raise SystemExit(3)
