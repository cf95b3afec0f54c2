"""``kvbm serve`` in a subprocess for the chaos harness: start, SIGKILL, SIGSTOP/SIGCONT, stop.

(tests/serve_proc.py is the suite's; this one lives in the package so ``kvbm bench chaos`` runs outside it.)
"""

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


class DaemonProc:
    """A daemon with config ``cfg`` written to ``tmp/kvbm.yaml``; restartable on the same directories."""

    def __init__(self, tmp: Path, cfg: dict[str, Any]) -> None:
        self.tmp = tmp
        self.cfg_path = tmp / "kvbm.yaml"
        self.cfg_path.write_text(json.dumps(cfg))
        self.log_path = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 60) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(self.cfg_path)],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        self.pids.append(self.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                for line in f:
                    if b'"daemon.started"' in line:
                        self.info = json.loads(line)
                        return
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited at start: {self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start within {timeout}s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        if self.alive():
            self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 15) -> bool:
        """SIGTERM (SIGCONT first: it may be stopped); SIGKILL after ``timeout``. Whether it stopped cleanly."""
        clean = True
        if self.alive():
            assert self.proc is not None
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                clean = False
                self.kill9()
        for pid in self.pids:  # a killed daemon's G2 pool stays in /dev/shm
            for f in glob.glob(f"/dev/shm/kvbm-g2-{pid}-*"):
                os.unlink(f)
        return clean
