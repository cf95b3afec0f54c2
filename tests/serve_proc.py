"""``python -m kvbm.cli.serve`` in a subprocess for tests: start, wait until it logs readiness, stop."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvbm.client import WorkerClient


class ServeProc:
    """A daemon with config ``cfg`` (written as ``tmp/kvbm.yaml``); restartable on the same directories.

    Its admin token file is ``tmp/admin.token`` unless ``cfg`` names one: :meth:`admin_token` reads it the
    way the CLI does, :meth:`client` with ``admin=True`` registers with it."""

    def __init__(self, tmp: Path, cfg: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.endpoint = cfg["daemon"].get("endpoint", "")  # unset: the daemon's default, read at start()
        self.env = env or {}  # extra environment of the daemon (say XDG_CACHE_HOME, which places the defaults)
        cfg["daemon"].setdefault("admin_token_file", str(tmp / "admin.token"))
        self.admin_token_path = Path(cfg["daemon"]["admin_token_file"])
        self.cfg_path = tmp / "kvbm.yaml"
        self.cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
        self.log_path = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.killed: int | None = None

    def start(self, timeout: float = 60, marks: tuple[str, ...] = ("daemon.started",)) -> ServeProc:
        """Start and wait until every log event in ``marks`` has appeared (``info`` = the started event)."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        # Only the config file speaks: KVBM_* variables of the test run would override it.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")} | self.env
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(self.cfg_path)],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                for line in f:
                    for mark in marks:
                        if f'"{mark}"'.encode() in line:
                            seen.add(mark)
                            if mark == "daemon.started":
                                self.info = json.loads(line)
            if seen == set(marks):
                self.endpoint = self.endpoint or self.info.get("endpoint", "")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not log {sorted(set(marks) - seen)}: {self.log_path.read_text()[-3000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.killed = self.proc.pid  # its G2 pool stays in /dev/shm until the next serve removes it

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()
                raise
        for pid in (self.proc.pid, self.killed):
            for f in glob.glob(f"/dev/shm/kvbm-g2-{pid}-*"):
                os.unlink(f)

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
