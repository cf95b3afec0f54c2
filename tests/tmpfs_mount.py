"""A size-limited tmpfs for the tests that need a real full, read-only or immutable filesystem: root may mount one
on this machine; elsewhere the test is skipped naming ``tmpfs`` (tests/needs.py)."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from needs import skip


@contextmanager
def mounted_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (mount's syntax: ``16m``) mounted in a new directory under ``parent``; unmounted
    afterwards (with what was mounted under it), retried while a process that is going away still holds it."""
    mnt = parent / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        skip("tmpfs", f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        for _ in range(20):
            if subprocess.run(["umount", "-R", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
