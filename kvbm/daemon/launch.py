"""``kvbm serve`` in a subprocess: write its config, start it, wait until its log says it is ready, signal it,
stop it and remove the G2 pools it left in /dev/shm. The one launcher of the benchmarks (:mod:`kvbm.bench`), the
verification and chaos harnesses (:mod:`kvbm.verify`, :mod:`kvbm.chaos`) and the suite (``tests/serve_proc.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvbm.security import UNIX_PATH_MAX, ipc_path

STARTED = "daemon.started"  # the event the daemon logs once it serves (kvbm.daemon.core)
_short_dir: Path | None = None  # this process's directory for sockets whose own path is too long


def ipc_endpoint(directory: Path, name: str) -> str:
    """``ipc://directory/name``; where that path does not fit a unix socket (a deep work directory: a user's
    ``--workdir``, pytest-xdist's temp dirs), a socket named for it in a short private directory of this process's
    (removed at exit), the same endpoint each time for the same path."""
    want = str(Path(directory).absolute() / name)
    if len(os.fsencode(want)) <= UNIX_PATH_MAX:
        return f"ipc://{want}"
    global _short_dir
    if _short_dir is None:
        _short_dir = Path(tempfile.mkdtemp(prefix="kvbm-ipc-"))  # 0700, the daemon's ipc directory check
        atexit.register(shutil.rmtree, _short_dir, True)
    return f"ipc://{_short_dir / hashlib.sha256(want.encode()).hexdigest()[:16]}-{name[-24:]}"


def ipc_exists(endpoint: str) -> Callable[[], bool]:
    """A ``ready`` check for :meth:`DaemonLauncher.start`: the daemon has bound ``endpoint``'s socket file."""
    path = Path(ipc_path(endpoint))
    return path.exists


class DaemonLauncher:
    """A daemon with config ``cfg`` (written as JSON, which is YAML, to ``root/kvbm.yaml``; its log appended to
    ``root/daemon.log``), restartable on the same directories.

    ``strip_env``: prefixes of this process's environment variables the daemon does not inherit (KVBM_* would
    override the config file; a bench also keeps its AWS_* credentials away); ``env``: variables added after."""

    def __init__(self, root: Path, cfg: dict[str, Any], *, name: str = "daemon", args: Sequence[str] = (),
                 env: dict[str, str] | None = None, strip_env: tuple[str, ...] = ("KVBM_",)) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.name, self.args = root, name, list(args)
        self.cfg_path = root / "kvbm.yaml"
        self.cfg_path.write_text(json.dumps(cfg))
        self.log_path = root / "daemon.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(strip_env)} | (env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every process started: a killed one's G2 pool stays in /dev/shm until stop()
        self.info: dict[str, Any] = {}  # the STARTED event of the last start

    def start(self, timeout_s: float = 60.0, marks: Sequence[str] = (STARTED,),
              ready: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Start and wait until this start has logged every event in ``marks`` and ``ready()`` (if given) is true;
        the STARTED event. Raises RuntimeError with the log's tail if the process exits or ``timeout_s`` passes."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0  # earlier starts' lines don't count
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(self.cfg_path),
                                          *self.args], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env)
        self.pids.append(self.proc.pid)
        self.info = {}
        seen: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                for line in f:
                    for mark in marks:
                        if f'"{mark}"'.encode() in line:
                            seen.add(mark)
                            if mark == STARTED:
                                with contextlib.suppress(ValueError):
                                    self.info = json.loads(line)
            if seen >= set(marks) and (ready is None or ready()):
                return self.info
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited (code {self.proc.returncode}): {self.tail()}")
            if time.monotonic() > deadline:
                missing = sorted(set(marks) - seen)
                what = f"did not log {missing}" if missing else "was not ready"
                raise RuntimeError(f"daemon {self.name} {what} within {timeout_s:.0f}s: {self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        """SIGKILL and reap: a crash, as the daemon's restart-recovery paths see one."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> bool:
        """SIGTERM (after SIGCONT: it may be SIGSTOPped), SIGKILL after ``timeout_s``; then remove the G2 pools of
        every process started. Whether it stopped on SIGTERM (true too if it was not running)."""
        clean = True
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                clean = False
                self.kill9()
        for pid in self.pids:
            for f in Path("/dev/shm").glob(f"kvbm-g2-{pid}-*"):
                with contextlib.suppress(OSError):
                    f.unlink()
        return clean
