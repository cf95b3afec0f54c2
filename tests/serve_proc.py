"""``python -m kvbm.cli.serve`` in a subprocess for tests: start, wait until it logs readiness, stop (the package's
launcher, :class:`kvbm.daemon.launch.DaemonLauncher`, with the suite's admin token and client helpers)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvbm.client import WorkerClient
from kvbm.daemon.launch import STARTED, DaemonLauncher


class ServeProc(DaemonLauncher):
    """A daemon with config ``cfg`` (written as ``tmp/kvbm.yaml``); restartable on the same directories.

    Its admin token file is ``tmp/admin.token`` unless ``cfg`` names one: :meth:`admin_token` reads it the
    way the CLI does, :meth:`client` with ``admin=True`` registers with it. Only the config file speaks: the
    KVBM_* variables of the test run do not reach the daemon; ``env`` adds variables (say XDG_CACHE_HOME)."""

    def __init__(self, tmp: Path, cfg: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.endpoint = cfg["daemon"].get("endpoint", "")  # unset: the daemon's default, read at start()
        cfg["daemon"].setdefault("admin_token_file", str(tmp / "admin.token"))
        self.admin_token_path = Path(cfg["daemon"]["admin_token_file"])
        super().__init__(tmp, cfg, env=env)
        self.killed: int | None = None

    def start(self, timeout: float = 60, marks: tuple[str, ...] = (STARTED,)) -> ServeProc:  # type: ignore[override]
        """Start and wait until every log event in ``marks`` has appeared (``info`` = the started event)."""
        super().start(timeout_s=timeout, marks=marks)
        self.endpoint = self.endpoint or self.info.get("endpoint", "")
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        super().kill9()
        self.killed = self.proc.pid  # its G2 pool stays in /dev/shm until the next serve (or stop()) removes it

    def stop(self, timeout_s: float = 15.0) -> bool:
        if not super().stop(timeout_s):
            raise RuntimeError(f"the daemon did not stop on SIGTERM within {timeout_s:.0f}s: {self.tail()}")
        return True

    def admin_token(self) -> str:
        """The token the daemon wrote at its first start (as any user with read access gets it)."""
        return self.admin_token_path.read_text().strip()

    def client(self, *, admin: bool = False, **kw: Any) -> WorkerClient:
        if admin:
            kw["admin_token"] = self.admin_token()
        return WorkerClient(self.endpoint, timeout_s=kw.pop("timeout_s", 10.0), **kw)


def wait_until(pred: Any, timeout: float = 60.0, step: float = 0.05) -> Any:
    """Call ``pred`` until it returns something truthy or ``timeout`` passes; its last result. A generous
    deadline for waiting on daemons, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)
