"""The schedule's daemon: ``kvbm serve`` with G2 only (what a load reads is what a save wrote), that a schedule
can SIGSTOP, SIGCONT, SIGKILL and restart, and whose stored blocks the harness reads back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import WorkerClient

BLOCK_BYTES = "256KiB"  # two 128 KiB vLLM blocks of the harness's float32 model: k = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VerifyDaemon:
    """``python -m kvbm.cli.serve`` on loopback TCP, G2 only (64 MiB: a schedule never evicts)."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"block_bytes": BLOCK_BYTES, "device": {"enabled": False}, "host": {"capacity": "64MiB"},
               "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
               "daemon": {"endpoint": self.endpoint, "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                          "metrics_port": -1, "admin_token_file": str(root / "admin.token")}}
        self.cfg_path = root / "kvbm.yaml"
        self.cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []  # every process started: their G2 pools are removed at stop
        self.stopped = False

    def start(self, timeout_s: float = 60.0) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_", "AWS_"))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(self.cfg_path)],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        self.pids.append(self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                if b'"daemon.started"' in f.read():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"the daemon did not start: {self.log_path.read_text()[-2000:]}")

    def sigstop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.stopped = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.stopped:
                self.sigcont()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.pids:
            for f in Path("/dev/shm").glob(f"kvbm-g2-{pid}-*"):
                with contextlib.suppress(OSError):
                    f.unlink()

    def read_blocks(self, layout: KVLayout, hashes: list[bytes]) -> dict[bytes, np.ndarray]:
        """The bytes the daemon holds under each of ``hashes`` (absent: not stored)."""
        out: dict[bytes, np.ndarray] = {}
        with WorkerClient(self.endpoint, timeout_s=10) as c:
            c.register(layout, worker_id="kvbm-verify-reader")
            for h in hashes:
                buf = np.zeros(c.registered.slot_bytes, np.uint8)
                if c.load([BlockKey(layout.namespace, h)], [buf]) == 1:
                    out[h] = buf
        return out
