"""Shared CLI plumbing: config loading and one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvbm.config import Config, load_config
from kvbm.errors import KvbmError

F = TypeVar("F", bound=Callable[..., Any])

config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), default=None, envvar="KVBM_CONFIG",
    help="YAML config file (default: the packaged configs/default.yaml). KVBM_* env vars override fields.",
)


def load(config_path: str | None) -> Config:
    return load_config(config_path)


def one_line_errors(fn: F) -> F:
    """Turn kvbm errors (and OS errors) into ``Error: <reason>`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (KvbmError, OSError) as e:
            logging.getLogger("kvbm").debug("command failed", exc_info=True)
            raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    return wrapper  # type: ignore[return-value]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
