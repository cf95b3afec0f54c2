"""The embedded SeaweedFS launcher: ports, startup errors, reuse, the background service CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm.errors import TierUnavailableError
from kvbm.s3server import EmbeddedS3, _pid_alive, pick_ports, port_free, stop_dir

pytestmark = pytest.mark.s3
ROOT = Path(__file__).resolve().parents[1]


def test_pick_ports_are_free_with_grpc_pairs():
    ports = pick_ports(4)
    assert len(set(ports)) == 4
    for p in ports:
        assert port_free(p) and port_free(p + 10000)
        assert all(abs(p - q) != 10000 for q in ports)


def test_startup_failure_reports_log_tail(tmp_path):
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fatal: boom from fake weed'\nexit 3\n")
    fake.chmod(0o755)
    srv = EmbeddedS3(tmp_path / "d", weed=str(fake), startup_timeout_s=10, reuse=False)
    with pytest.raises(TierUnavailableError, match=r"(?s)exited with code 3.*boom from fake weed"):
        srv.start()
    assert srv.pid is None


def test_reuses_running_server(s3_server):
    other = EmbeddedS3(s3_server.dir, access_key=s3_server.access_key, secret_key=s3_server.secret_key,
                       bucket=s3_server.bucket)
    other.start()
    assert other.reused and other.endpoint == s3_server.endpoint and other.pid == s3_server.pid
    other.stop()  # leaves a reused server running
    assert s3_server.running
    assert EmbeddedS3(s3_server.dir).status()["running"]


def test_background_service_cli(weed_binary, tmp_path):
    d = tmp_path / "svc"
    env = dict(os.environ, KVBM_WEED=weed_binary, KVBM_PYTHON=sys.executable)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvbm.s3server", *args, "--dir", str(d)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=90)

    try:
        r = cli("start")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["status"] == "started" and info["endpoint"].startswith("http://127.0.0.1:")
        pid = info["pid"]
        assert _pid_alive(pid) and (d / "weed.pid").read_text().strip() == str(pid)
        assert "kvbm-local-secret" not in (d / "kvbm-s3.json").read_text()
        again = json.loads(cli("start").stdout)
        assert again["status"] == "reused" and again["pid"] == pid
        st = subprocess.run(["bash", str(ROOT / "scripts" / "seaweedfs.sh"), "status", "--dir", str(d)],
                            capture_output=True, text=True, env=env, timeout=60)
        assert st.returncode == 0 and json.loads(st.stdout)["running"], st.stderr
        r = cli("stop", "--timeout", "1")
        assert json.loads(r.stdout)["status"] == "stopped"
        assert not _pid_alive(pid)
        r = cli("status")
        assert r.returncode == 3 and not json.loads(r.stdout)["running"]
    finally:
        stop_dir(d, stop_timeout_s=0.5)
