"""``kvbm purge``: delete cached blocks from the bucket and/or the disk tier, safely."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import click

from kvbm.cli.common import SIZE, CliState, config_option, daemon_options, one_line_errors, pass_state
from kvbm.config.schema import human_bytes
from kvbm.errors import ConfigError
from kvbm.ops import parse_duration
from kvbm.ops.purge_run import PurgeOptions, PurgeUI, PurgeUsageError, run_purge


def _duration(_ctx: Any, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ConfigError as e:
        raise click.BadParameter(str(e), param=param) from None


@click.command("purge")
@config_option
@click.option("--older-than", "older_than", metavar="AGE", callback=_duration,
              help="Blocks last written more than AGE ago (s/m/h/d/w, e.g. 7d, 12h, 1d12h).")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Only this layout namespace (<model-slug>-<16 hex>); repeatable.")
@click.option("--model", metavar="SLUG", help="Only namespaces of this model (e.g. meta-llama/Llama-3.1-8B).")
@click.option("--prefix", metavar="KEY", help="Blocks whose key starts with KEY, relative to kvbm's prefix: "
              "<namespace>/<shard>/<hash> (e.g. 'llama-3-8b-0123456789abcdef/ab').")
@click.option("--all", "all_", is_flag=True,
              help="Every block in scope (of --namespace/--model, or of every namespace).")
@click.option("--max-bytes", metavar="SIZE", type=SIZE,
              help="Keep each namespace at most SIZE (e.g. 10GiB) per store, deleting its least recently used "
                   "blocks first.")
@click.option("--by", "by", type=click.Choice(["access", "written", "value"]), default="access", show_default=True,
              help="Age and rank blocks by their last use anywhere in the fleet (the bucket's access logs; "
                   "write time where none is recorded), or by write time only; value: as access, but --max-bytes "
                   "keeps what the placement policy values most (blocks hit since written before one-offs).")
@click.option("--access-log-retention", "log_keep", metavar="AGE", callback=_duration, default="30d",
              show_default=True, help="Delete access logs older than AGE (their hits no longer protect a block).")
@click.option("--from", "from_", type=click.Choice(["bucket", "disk", "both"]), default="both", show_default=True,
              help="Which store to purge.")
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted (count and bytes).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation (needed without a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@daemon_options
@one_line_errors
@pass_state
def purge(state: CliState, older_than: float | None, namespaces: tuple[str, ...], model: str | None,
          prefix: str | None, all_: bool, max_bytes: int | None, by: str, log_keep: float, from_: str,
          dry_run: bool, yes: bool, as_json: bool, daemon_endpoint: str | None, direct: bool,
          daemon_timeout: float) -> None:
    """Delete cached KV blocks by age, namespace, model, key prefix or size budget.

    Scope with --namespace / --model / --prefix; choose with --older-than, --max-bytes, --prefix or
    --all (at least one is required: a bare `kvbm purge` deletes nothing). Criteria add up: with both
    an age and a budget, blocks unused for longer than the age go, then the least recently used of the
    rest until each namespace fits in the budget. "Used" is the later of the write time and the last hit
    any daemon of the fleet recorded in the bucket's access logs (--by written ignores the logs).

    Only kvbm block keys are ever deleted: objects under the configured s3.prefix that parse as
    <namespace>/<shard>/<hash>, and <namespace>/<hh>/<hash>.kvb files in the disk directory. Other
    objects in the same bucket are never touched. Deletes go 1,000 keys per request; the run is
    idempotent, so an interrupted purge is finished by running it again. A running daemon is told
    which blocks went, so its index stays true (best effort).

    \b
    Examples:
      kvbm purge --older-than 7d --dry-run
      kvbm purge --model meta-llama/Llama-3.1-8B --all --yes
      kvbm purge --max-bytes 200GiB --from bucket --yes      # nightly budget (see scripts/cron)
    """
    say = (lambda *_a, **_k: None) if as_json else click.echo
    opts = PurgeOptions(namespaces=namespaces, model=model, prefix=prefix, older_than_s=older_than, all=all_,
                        max_bytes=max_bytes, by=by, log_keep_s=log_keep, source=from_, dry_run=dry_run, yes=yes,
                        daemon_endpoint=daemon_endpoint, direct=direct, daemon_timeout_s=daemon_timeout)
    try:
        s = run_purge(state.config, opts, PurgeUI(say=say, confirm=_confirm, progress=_progress(as_json)))
    except PurgeUsageError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(s))
    elif "seconds" in s:  # something was deleted (or tried)
        say(f"deleted {s['deleted']} of {s['selected']} blocks, freed {human_bytes(s['bytes_freed'])} in "
            f"{s['seconds']:.1f}s; {s['errors']} errors")
        for err in s["error_samples"][:5]:
            say(f"  error: {err['key']}: {err['error']}")
        say(f"daemon: {s['daemon']}")
    if s.get("interrupted"):
        raise click.ClickException(f"purge stopped early ({s['interrupted']}); run the same command again to finish")
    if s["errors"]:
        raise click.ClickException(f"{s['errors']} blocks could not be deleted")


def _confirm(blocks: int, nbytes: int, logs: int) -> bool:
    if not sys.stdin.isatty():
        raise click.ClickException(f"refusing to delete {blocks} blocks without confirmation: "
                                   "no terminal to ask on (pass --yes, or --dry-run to look first)")
    click.confirm(f"Delete {blocks} blocks ({human_bytes(nbytes)})"
                  + (f" and {logs} old access logs" if logs else "") + "?", abort=True)
    return True


def _progress(hidden: bool) -> Any:
    @contextlib.contextmanager
    def bar(total: int) -> Iterator[Any]:
        with click.progressbar(length=total, label="deleting", file=sys.stderr, hidden=hidden) as b:
            yield b.update

    return bar
