"""The one launcher of ``kvbm serve`` subprocesses (kvbm.daemon.launch), as the benches use it
(kvbm.bench.common.DaemonProc): a restart on the same directory, whose log the starts append to, is ready only
once this start has logged ``daemon.started``, and stop removes every started process's G2 pool."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from kvbm.bench.common import DaemonProc


def _cfg(tmp: Path) -> dict:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB"},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": f"ipc://{tmp}/ev.sock", "metrics_port": 0,
                   "admin_token_file": str(tmp / "admin.token")},
    }


def _started(log: bytes) -> list[int]:
    return [json.loads(line)["pid"] for line in log.splitlines() if b'"daemon.started"' in line]


def test_a_restart_is_ready_on_its_own_start_event_and_stop_removes_every_pool(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, _cfg(tmp_path))
    d.start()
    first = d.proc.pid
    try:
        assert _started(d.log_path.read_bytes()) == [first]
        assert glob.glob(f"/dev/shm/kvbm-g2-{first}-*"), "a running daemon has its G2 pool"
        d.proc.kill()  # SIGKILL: its pool stays in /dev/shm (the next start removes a dead daemon's pool)
        d.proc.wait(10)
        offset = d.log_path.stat().st_size
        d.start()  # the first start's event is in the log already: only this start's counts
        second = d.proc.pid
        assert second != first
        assert _started(d.log_path.read_bytes()[offset:]) == [second], d.log_path.read_text()[-2000:]
    finally:
        d.stop()
    assert not glob.glob(f"/dev/shm/kvbm-g2-{first}-*") and not glob.glob(f"/dev/shm/kvbm-g2-{second}-*")
