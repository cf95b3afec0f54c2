"""``kvbm config show``: the effective config, secrets redacted, with where each value came from."""

from __future__ import annotations

import json
from typing import Any

import click
import msgspec

from kvbm.cli.common import CliState, config_option, one_line_errors, pass_state
from kvbm.config import SIZE_FIELDS, Config, format_size
from kvbm.redact import is_secret_name

REDACTED = "<redacted>"


def effective_fields(cfg: Config, sources: dict[str, str]) -> list[dict[str, Any]]:
    """One row per field: ``field`` (dotted), ``value`` (secrets redacted), ``source``."""
    rows: list[dict[str, Any]] = []

    def add(path: str, name: str, value: Any) -> None:
        if is_secret_name(name) and value:
            value = REDACTED
        elif path in SIZE_FIELDS:
            value = format_size(value)
        rows.append({"field": path, "value": value, "source": sources.get(path, "default")})

    for f in msgspec.structs.fields(Config):
        value = getattr(cfg, f.name)
        if isinstance(value, msgspec.Struct):
            for sub in msgspec.structs.fields(value):
                add(f"{f.name}.{sub.name}", sub.name, getattr(value, sub.name))
        else:
            add(f.name, f.name, value)
    return rows


@click.group("config")
def config() -> None:
    """Inspect the configuration."""


@config.command("show")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@one_line_errors
@pass_state
def show(state: CliState, as_json: bool) -> None:
    """Print the effective config: every field, its value and where it came from (default, file, or env with
    the variable's name). Credentials (access/secret keys, session token, CURVE secret) print as <redacted>.

    \b
    Examples:
      kvbm config show
      KVBM_S3_BUCKET=kv kvbm config show --config my.yaml --json
    """
    rows = effective_fields(*state.config_sources)
    if as_json:
        click.echo(json.dumps({"config_file": state.config_file, "fields": rows}, indent=2, default=str))
        return
    click.echo(f"# config file: {state.config_file or 'configs/default.yaml (packaged)'}")
    width = max(len(r["field"]) for r in rows)
    vwidth = min(48, max(len(json.dumps(r["value"], default=str)) for r in rows))
    for r in rows:
        click.echo(f"{r['field']:<{width}}  {json.dumps(r['value'], default=str):<{vwidth}}  # {r['source']}")
