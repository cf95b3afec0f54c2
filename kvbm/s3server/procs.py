"""Process identity and termination for ``weed`` servers: whether a pid is alive and is ``weed``, which
``weed server`` processes serve a data dir (through /proc), and stopping one by its process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from kvbm.s3server.ports import PORT_NAMES


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not; one we may not signal does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def pid_is_weed(pid: int) -> bool:
    """Whether ``pid`` is a weed process (when /proc cannot tell: whether it is alive)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"weed" in f.read()
    except OSError:
        return pid_alive(pid)


def weed_cmdline(pid: int) -> list[str] | None:
    """The argv of ``pid`` if it is a ``weed server``, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    return argv if argv and os.path.basename(argv[0]) == "weed" and argv[1:2] == ["server"] else None


def weeds_serving(dir: str | os.PathLike[str]) -> list[tuple[int, dict[str, int]]]:
    """``(pid, ports)`` of every live ``weed server`` whose ``-dir`` is ``dir`` (found through /proc)."""
    want = os.path.realpath(dir)
    out: list[tuple[int, dict[str, int]]] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        argv = weed_cmdline(pid)
        if argv is None or not pid_alive(pid):
            continue
        opts = dict(a[1:].split("=", 1) for a in argv[2:] if a.startswith("-") and "=" in a)
        d = opts.get("dir")
        if d is None:
            continue
        if not os.path.isabs(d):
            try:
                d = os.path.join(os.readlink(f"/proc/{pid}/cwd"), d)
            except OSError:
                continue
        if os.path.realpath(d) != want:
            continue
        ports: dict[str, int] = {}
        for name in PORT_NAMES:
            v = opts.get(f"{name}.port")
            if v and v.isdigit():
                ports[name] = int(v)
        out.append((pid, ports))
    return out


def terminate(pid: int, wait_s: float, proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM ``pid``'s process group (never ours), SIGKILL after ``wait_s`` (at once if 0); wait until gone."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == os.getpgrp():
        pgid = None  # never signal our own group

    def _signal(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pgid is not None:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)

    def _gone(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None:
                if proc.poll() is not None:
                    return True
            elif not pid_alive(pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    if wait_s > 0:
        _signal(signal.SIGTERM)
        if _gone(wait_s):
            return
    _signal(signal.SIGKILL)
    _gone(10.0)
