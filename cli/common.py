"""Shared CLI plumbing: the state the ``kvbm`` group hands its commands (:class:`CliState` in ``ctx.obj``, the
config loaded once on first use), one-line errors instead of tracebacks, and the daemon options of
``status``, ``purge`` and ``prewarm``."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvbm.config import SIZE_HINT, Config, Source, load_config_sources, parse_size
from kvbm.errors import ConfigError, KvbmError
from kvbm.ops.link import DaemonLink

F = TypeVar("F", bound=Callable[..., Any])

class CliState:
    """What the ``kvbm`` group hands its commands: the config file named by ``--config`` (before or after the
    command; the command's wins) and the config, loaded once, when a command first asks for it, so
    ``kvbm --help`` and ``kvbm keys generate`` never read one."""

    def __init__(self, config_path: str | None = None) -> None:
        self.config_path = config_path  # None: $KVBM_CONFIG, else the packaged default
        self._loaded: tuple[Config, dict[str, Source]] | None = None

    def use_config(self, path: str) -> None:
        self.config_path = path
        self._loaded = None

    @property
    def config_file(self) -> str | None:
        """The file the config comes from (None: the packaged default)."""
        return self.config_path or os.environ.get("KVBM_CONFIG") or None

    @property
    def config(self) -> Config:
        """The validated config (ConfigError naming the field otherwise)."""
        return self.config_sources[0]

    @property
    def config_sources(self) -> tuple[Config, dict[str, Source]]:
        """The config and where each field set came from (``kvbm config show``)."""
        if self._loaded is None:
            self._loaded = load_config_sources(self.config_file)
        return self._loaded


pass_state = click.make_pass_decorator(CliState, ensure=True)


def _command_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(CliState).use_config(value)


_CONFIG_HELP = "YAML config file (default: $KVBM_CONFIG, else the packaged configs/default.yaml). KVBM_* env " \
               "vars override fields."
# On the group (``kvbm --config FILE CMD``) and, as ever, on each command that reads a config.
group_config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                                   help=_CONFIG_HELP)
config_option = click.option("--config", type=click.Path(dir_okay=False), default=None, expose_value=False,
                             callback=_command_config, help=_CONFIG_HELP)


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


class SizeType(click.ParamType):
    """A size option (``--max-bytes 500GiB``): parsed once, by the config's own parser; >= 0."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            n = parse_size(value)
        except ConfigError:
            self.fail(f"cannot read {value!r} as a size ({SIZE_HINT})", param, ctx)
        if n < 0:
            self.fail("must be >= 0", param, ctx)
        return n


SIZE = SizeType()


# -- daemon options: shared by status, purge and prewarm -----------------------------------------------
def daemon_options(fn: F) -> F:
    """``--daemon``, ``--direct`` and ``--timeout``."""
    fn = click.option("--timeout", "daemon_timeout", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
                      help="Seconds to wait for the daemon's answer.")(fn)
    fn = click.option("--direct", is_flag=True,
                      help="Do not talk to a daemon; work on the disk directory and the bucket directly.")(fn)
    fn = click.option("--daemon", "daemon_endpoint", metavar="ENDPOINT", envvar="KVBM_DAEMON", default=None,
                      help="Daemon endpoint (e.g. tcp://127.0.0.1:5557, ipc:///run/kvbm.sock); $KVBM_DAEMON. "
                           "Given explicitly, an unreachable daemon is an error; otherwise daemon.endpoint of "
                           "the config is tried quickly and the command works directly when nothing answers.")(fn)
    return fn


def find_daemon(cfg: Config, endpoint: str | None, direct: bool, timeout_s: float) -> tuple[DaemonLink | None, str]:
    """A registered link to the daemon, or (None, why not) (:func:`kvbm.ops.purge_run.find_link`). An explicit
    ``endpoint`` that does not answer raises ClickException; the configured default falls back quietly."""
    from kvbm.ops.purge_run import find_link

    try:
        return find_link(cfg, endpoint, direct, timeout_s)
    except KvbmError as e:
        raise click.ClickException(str(e)) from None
