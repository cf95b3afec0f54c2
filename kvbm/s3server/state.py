"""The files an embedded SeaweedFS keeps in its data dir: the state file (pid, ports, access key), the
S3 identity with its secret (mode 0600), and the lock that serializes starting and stopping."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbm.errors import TierUnavailableError

STATE_FILE = "kvbm-s3.json"
PID_FILE = "weed.pid"
LOG_FILE = "weed.log"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "kvbm-s3.lock"


@contextlib.contextmanager
def dir_lock(dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``<dir>/kvbm-s3.lock`` exclusively (waiting up to ``timeout_s``); the kernel drops it if we die."""
    dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TierUnavailableError(
                        f"another process has been starting or stopping the SeaweedFS of {dir} for over "
                        f"{timeout_s:.0f}s (lock {dir / LOCK_FILE})"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def read_state(dir: Path) -> dict[str, Any] | None:
    """The dir's state file, or None when it is missing or unreadable."""
    try:
        return json.loads((dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_state(dir: Path, state: dict[str, Any]) -> None:
    """Replace the state file atomically (never the secret: callers pass the access key only)."""
    tmp = dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, dir / STATE_FILE)


def stored_secret(dir: Path, access_key: str) -> str:
    """The secret this dir's identity file holds for ``access_key`` ("" when none)."""
    try:
        ident = json.loads((dir / IDENTITY_FILE).read_text())
        for who in ident.get("identities", []):
            for cred in who.get("credentials", []):
                if cred.get("accessKey") == access_key and cred.get("secretKey"):
                    return str(cred["secretKey"])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return ""


def write_identity(dir: Path, access_key: str, secret_key: str) -> Path:
    """Write the S3 identity (``-s3.config``) with mode 0600; returns its path."""
    path = dir / IDENTITY_FILE
    ident = {
        "identities": [
            {
                "name": "kvbm",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(ident, f)
    return path
