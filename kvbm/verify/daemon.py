"""The schedule's daemon: ``kvbm serve`` with G2 only (what a load reads is what a save wrote), that a schedule
can SIGSTOP, SIGCONT, SIGKILL and restart, and whose stored blocks the harness reads back."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np

from kvbm.bench.openai_server import free_port as _free_port
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import WorkerClient
from kvbm.daemon.launch import DaemonLauncher

BLOCK_BYTES = "256KiB"  # two 128 KiB vLLM blocks of the harness's float32 model: k = 2


def free_port() -> int:
    return _free_port()  # not from the kernel's ephemeral range (kvbm.bench.openai_server)


class VerifyDaemon:
    """``python -m kvbm.cli.serve`` on loopback TCP, G2 only (64 MiB: a schedule never evicts)."""

    def __init__(self, root: Path) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"block_bytes": BLOCK_BYTES, "device": {"enabled": False}, "host": {"capacity": "64MiB"},
               "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
               "daemon": {"endpoint": self.endpoint, "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                          "metrics_port": -1, "admin_token_file": str(root / "admin.token")}}
        self.launcher = DaemonLauncher(root, cfg, strip_env=("KVBM_", "AWS_"))
        self.log_path = self.launcher.log_path
        self.stopped = False  # SIGSTOPped by the schedule

    def start(self, timeout_s: float = 60.0) -> None:
        self.launcher.start(timeout_s)

    def sigstop(self) -> None:
        self.launcher.signal(signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        self.launcher.signal(signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        self.launcher.kill9()
        self.stopped = False

    def alive(self) -> bool:
        return self.launcher.alive()

    def stop(self) -> None:
        self.launcher.stop(20)
        self.stopped = False

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
