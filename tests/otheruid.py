"""Run a small pyzmq script as another local user (uid/gid 65534), for checks of who may reach the daemon.

Tests run as root here; the script runs under ``setpriv --reuid=65534 --regid=65534 --clear-groups`` with
the system python3 (root's interpreter lives in a home that user cannot enter) and only this venv's
site-packages (pyzmq, msgspec) on its path. :func:`available` says whether that works on this machine;
tests call ``require("otheruid", *available())`` so CI's KVBM_REQUIRE fails rather than skips them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import zmq

OTHER_UID = 65534
SITE = str(Path(zmq.__file__).resolve().parent.parent)  # the site-packages holding pyzmq


def _python() -> str:
    """A system python3 of this interpreter's minor version (pyzmq's extension is built for it), or ""."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if not cand or not os.path.exists(cand) or str(Path(cand).resolve()).startswith(str(Path.home())):
            continue
        out = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == str(tuple(sys.version_info[:2])):
            return cand
    return ""


def available() -> tuple[bool, str]:
    """(ok, why not): root, setpriv, and a python the other user may run that imports pyzmq."""
    if os.geteuid() != 0:
        return False, "not root: cannot drop to another uid"
    if not shutil.which("setpriv"):
        return False, "no setpriv"
    py = _python()
    if not py:
        return False, f"no system python3 {sys.version_info[0]}.{sys.version_info[1]} outside root's home"
    got = run_as_other("import zmq; out['ok'] = zmq.zmq_version()", timeout=30)
    if "error" in got:
        return False, f"uid {OTHER_UID} cannot import pyzmq from {SITE}: {got['error']}"
    return True, ""


def run_as_other(body: str, timeout: float = 60, **inputs: Any) -> dict[str, Any]:
    """Run ``body`` as uid 65534 with ``inp`` (the JSON of ``inputs``) and ``out`` (a dict it fills, returned);
    an exception in it comes back as ``out["error"]``."""
    return result(spawn_as_other(body, **inputs), timeout)


def spawn_as_other(body: str, **inputs: Any) -> subprocess.Popen[str]:
    """:func:`run_as_other` started in the background; :func:`result` waits for it."""
    script = ("import json, sys, traceback\ninp = json.loads(sys.argv[1])\nout = {}\ntry:\n"
              + "".join(f"    {line}\n" for line in body.splitlines())
              + "except Exception as e:\n    out['error'] = f'{type(e).__name__}: {e}'\nprint(json.dumps(out))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": SITE, "HOME": "/nonexistent", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                             _python() or "/usr/bin/python3", "-c", script, json.dumps(inputs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/")


def result(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"rc {proc.returncode}: {stderr[-500:]}"}
    return json.loads(lines[-1])


# For ``inp["wait_s"]`` seconds: send the request frame ``inp["frame"]`` (hex) to every endpoint of
# ``inp["requests"]`` and count replies per endpoint; subscribe to every ``inp["events"]`` and count batches.
PROBE = """
import zmq, time
ctx = zmq.Context()
socks = {}
for ep in inp.get("requests", []):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(ep); s.send(bytes.fromhex(inp["frame"]))
    socks[s] = ("replies", ep)
for ep in inp.get("events", []):
    s = ctx.socket(zmq.SUB); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(ep)
    socks[s] = ("events", ep)
out["replies"] = {ep: 0 for ep in inp.get("requests", [])}
out["events"] = {ep: 0 for ep in inp.get("events", [])}
poller = zmq.Poller()
for s in socks: poller.register(s, zmq.POLLIN)
deadline = time.monotonic() + inp["wait_s"]
while time.monotonic() < deadline:
    for s, _ in poller.poll(100):
        s.recv_multipart()
        kind, ep = socks[s]
        out[kind][ep] += 1
"""
