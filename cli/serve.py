"""``kvbm serve``: build the configured tiers and run the daemon."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import click
import msgspec

from kvbm.cli.common import CliState, config_option, pass_state
from kvbm.config import Config
from kvbm.errors import KvbmError


async def run_daemon(cfg: Config) -> None:
    """Build the stack (G2 and below: the GPU belongs to the workers) and serve until SIGINT/SIGTERM."""
    from kvbm.daemon import serve
    from kvbm.stack import build_stack

    # An S3 outage must not take G2/G3 down with it: G4 starts offline and joins when S3 answers.
    stack = await build_stack(cfg, device=False, start=False, wait_for_s3=True)
    try:
        await serve(cfg, stack.manager)  # starts the manager, which re-indexes disk and the bucket
    finally:
        await stack.close()


@click.command("serve")
@config_option
@click.option("--endpoint", default=None, help="Request endpoint, e.g. ipc:///run/kvbm.sock or tcp://127.0.0.1:5557.")
@click.option("--metrics-port", type=int, default=None, help="Prometheus port (0 disables, -1 picks a free one).")
@click.option("--foreground/--background", default=True, show_default=True,
              help="Run in this process, or detach into the background and print its pid.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
@pass_state
def serve(state: CliState, endpoint: str | None, metrics_port: int | None, foreground: bool, log_level: str) -> None:
    """Run the kvbm daemon (workers connect to its endpoint)."""
    try:
        cfg = state.config
    except KvbmError as e:
        raise click.ClickException(str(e)) from None
    changes: dict[str, object] = {}
    if endpoint is not None:
        changes["endpoint"] = endpoint
    if metrics_port is not None:
        changes["metrics_port"] = metrics_port
    if changes:
        cfg = msgspec.structs.replace(cfg, daemon=msgspec.structs.replace(cfg.daemon, **changes))
    if not foreground:
        args = [sys.executable, "-m", "kvbm.cli.serve", "--foreground", "--log-level", log_level]
        for opt, val in (("--config", state.config_path), ("--endpoint", endpoint), ("--metrics-port", metrics_port)):
            if val is not None:
                args += [opt, str(val)]
        proc = subprocess.Popen(args, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
        click.echo(f"kvbm daemon started in the background: pid {proc.pid}, endpoint {cfg.daemon.endpoint}")
        return
    from kvbm.daemon import configure_logging

    configure_logging(cfg.daemon.log_format, getattr(logging, log_level.upper()))
    from kvbm.tiers.host import remove_stale_pools

    stale = remove_stale_pools()
    if stale:
        logging.getLogger("kvbm.serve").info("removed stale G2 pools", extra={"kv": {"pools": stale}})
    try:
        asyncio.run(run_daemon(cfg))
    except KvbmError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        pass
    finally:
        logging.shutdown()


if __name__ == "__main__":
    serve()
