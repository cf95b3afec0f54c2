"""The one launcher of ``kvbm serve`` subprocesses (kvbm.daemon.launch), as the benches use it
(kvbm.bench.common.DaemonProc): a restart on the same directory, whose log the starts append to, is ready only
once this start has logged ``daemon.started``, and stop removes every started process's G2 pool."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from kvbm.bench.common import DaemonProc
from kvbm.client import WorkerClient
from kvbm.daemon.launch import ipc_endpoint, ipc_exists


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


def test_a_work_dir_too_deep_for_a_unix_socket_still_serves(tmp_path: Path) -> None:
    """A bench or harness run under a deep directory (a user's --workdir, pytest-xdist's temp dirs): its daemons'
    ipc sockets go to a short directory of the launching process's instead of failing to start (the path of a
    unix socket is at most 107 bytes); the same directory and name give the same endpoint."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    ep = ipc_endpoint(deep, "d.sock")
    assert ep == ipc_endpoint(deep, "d.sock") and len(ep) - len("ipc://") <= 107, ep
    assert ipc_endpoint(tmp_path, "d.sock") == f"ipc://{tmp_path}/d.sock"  # one that fits stays where it was asked
    cfg = _cfg(tmp_path) | {"daemon": {"endpoint": ep, "events_endpoint": ipc_endpoint(deep, "ev.sock"),
                                       "metrics_port": 0, "admin_token_file": str(tmp_path / "admin.token")}}
    d = DaemonProc(deep, cfg)
    d.start(ready=ipc_exists(ep))
    try:
        with WorkerClient(ep, timeout_s=10.0) as c:
            c.ping()
    finally:
        assert d.stop()
