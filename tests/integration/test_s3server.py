"""The embedded SeaweedFS launcher: ports, startup errors, reuse, the background service CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbm.errors import TierUnavailableError
from kvbm.s3server import STATE_FILE, EmbeddedS3, pick_ports, pid_alive, port_free, stop_dir

pytestmark = pytest.mark.s3
ROOT = Path(__file__).resolve().parents[2]


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
        assert pid_alive(pid) and (d / "weed.pid").read_text().strip() == str(pid)
        assert "kvbm-local-secret" not in (d / "kvbm-s3.json").read_text()
        again = json.loads(cli("start").stdout)
        assert again["status"] == "reused" and again["pid"] == pid
        st = subprocess.run(["bash", str(ROOT / "scripts" / "seaweedfs.sh"), "status", "--dir", str(d)],
                            capture_output=True, text=True, env=env, timeout=60)
        assert st.returncode == 0 and json.loads(st.stdout)["running"], st.stderr
        r = cli("stop", "--timeout", "1")
        assert json.loads(r.stdout)["status"] == "stopped"
        assert not pid_alive(pid)
        r = cli("status")
        assert r.returncode == 3 and not json.loads(r.stdout)["running"]
    finally:
        stop_dir(d, stop_timeout_s=0.5)


# -- one embedded SeaweedFS per data directory ----------------------------------------------------------------
def weeds_on(d: Path) -> list[int]:
    """Pids of every weed process serving ``d``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"weed") and f"-dir={d}".encode() in cmd:
            out.append(int(pid))
    return out


def test_concurrent_embedded_starts_share_one_server(weed_binary, tmp_path):
    d = tmp_path / "weed"
    gate = tmp_path / "go"
    script = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(gate)!r}): time.sleep(0.005)\n"
        "from kvbm.s3server import main\n"
        f"sys.exit(main(['start', '--dir', {str(d)!r}, '--timeout', '90']))\n"
    )
    env = {**os.environ, "KVBM_WEED": weed_binary}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=ROOT, env=env) for _ in range(2)]
    try:
        time.sleep(1.0)  # both interpreters up and polling for the gate (a gate, not a timing assertion)
        gate.touch()
        outs = [p.communicate(timeout=180) for p in procs]
        for p, (_o, e) in zip(procs, outs, strict=True):
            assert p.returncode == 0, e.decode()[-2000:]
        reps = [json.loads(o) for o, _ in outs]
        assert sorted(r["status"] for r in reps) == ["reused", "started"]
        assert reps[0]["pid"] == reps[1]["pid"] and reps[0]["endpoint"] == reps[1]["endpoint"]
        assert weeds_on(d) == [reps[0]["pid"]]
        assert json.loads((d / STATE_FILE).read_text())["pid"] == reps[0]["pid"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop_dir(d)
        for pid in weeds_on(d):
            os.kill(pid, 9)
    assert weeds_on(d) == []


def test_orphan_weed_on_the_directory_is_adopted(weed_binary, tmp_path):
    """A weed serving the directory that the state file does not name is reused, never run alongside."""
    d = tmp_path / "weed"
    env = {**os.environ, "KVBM_WEED": weed_binary}
    start = [sys.executable, "-m", "kvbm.s3server", "start", "--dir", str(d)]
    try:
        first = json.loads(subprocess.run(start, capture_output=True, check=True, env=env, timeout=120).stdout)
        state = json.loads((d / STATE_FILE).read_text())
        state["pid"] = None  # the state file lost track of it
        (d / STATE_FILE).write_text(json.dumps(state))
        again = json.loads(subprocess.run(start, capture_output=True, check=True, env=env, timeout=120).stdout)
        assert again["status"] == "reused" and again["pid"] == first["pid"]
        assert again["endpoint"] == first["endpoint"]
        assert weeds_on(d) == [first["pid"]]
        assert json.loads((d / STATE_FILE).read_text())["pid"] == first["pid"]
    finally:
        stop_dir(d)
        for pid in weeds_on(d):
            os.kill(pid, 9)
    assert weeds_on(d) == []


def test_a_disk_under_the_servers_free_floor_is_named_at_once(weed_binary, tmp_path):
    """A volume server refusing writes for want of disk space is said so, not a 60 s ReadTimeout at the end.

    (CI's host once had 2.4 GB of 270 GB free: under SeaweedFS's default 1% floor, every PUT was refused.)"""
    import shutil

    floor = f"{(shutil.disk_usage(tmp_path).free >> 20) + 8192}MiB"  # 8 GiB more than is free: refused
    srv = EmbeddedS3(tmp_path / "d", weed=weed_binary, startup_timeout_s=50, reuse=False, min_free_space=floor)
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError, match=r"refuses writes: .* free on the disk of .*under the .* it keeps"):
        srv.start()
    assert time.monotonic() - t0 < 45
    assert srv.pid is None or not srv.running


def test_the_default_free_floor_is_absolute_and_a_restart_reads_only_its_own_log(weed_binary, tmp_path):
    """The floor is not 1% of the disk (2.7 GB of a 270 GB one), and an old start's refusal does not fail a new one."""
    from kvbm.s3server.weed import MIN_FREE_SPACE, START_MARK, disk_refusal

    assert MIN_FREE_SPACE.endswith("MiB") and int(MIN_FREE_SPACE[:-3]) <= 1024
    log = tmp_path / "weed.log"
    refused = "I1206 17:22:28.222752 disk_location.go:731 dir /x disk free 66.20 GiB < required 70.20 GiB\n"
    log.write_text(f"{START_MARK} starting weed\n{refused}")
    assert "66.20 GiB free on the disk of /x, under the 70.20 GiB" in (disk_refusal(log) or "")
    log.write_text(f"{START_MARK} starting weed\n{refused}\n{START_MARK} starting weed\nI1206 all well\n")
    assert disk_refusal(log) is None
    log.write_text(f"{START_MARK} starting weed\n{refused}")
    assert disk_refusal(log, offset=log.stat().st_size) is None  # read from where this start began
    with EmbeddedS3(tmp_path / "d", weed=weed_binary, reuse=False) as srv:  # the default floor: it serves
        assert srv.running and disk_refusal(srv.log_path) is None


def test_the_configs_free_floor_reaches_the_server_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """``embedded_s3.min_free_disk`` (YAML or KVBM_ override) is the floor ``kvbm serve``'s SeaweedFS starts with."""
    from kvbm.config import load_config
    from kvbm.errors import ConfigError
    from kvbm.s3server import service

    monkeypatch.setenv("KVBM_EMBEDDED_S3_MIN_FREE_DISK", "1GiB")
    cfg = load_config(None)
    assert cfg.embedded_s3.min_free_disk == 1 << 30
    seen: dict[str, object] = {}
    monkeypatch.setattr(service, "ensure_running", lambda dir, **kw: seen.update(kw))
    service.embedded_from_config(cfg.embedded_s3)
    assert seen["min_free_space"] == "1024MiB"
    monkeypatch.setenv("KVBM_EMBEDDED_S3_MIN_FREE_DISK", "lots")
    with pytest.raises(ConfigError, match=r"embedded_s3\.min_free_disk"):
        load_config(None)
