"""The embedded SeaweedFS of a data dir as a background service: ensure it runs (``kvbm serve``, the
command line), start it from the config, and stop it with any orphans."""

from __future__ import annotations

import os
from typing import Any

from kvbm.s3server import state as st
from kvbm.s3server.embedded import EmbeddedS3
from kvbm.s3server.procs import pid_alive, pid_is_weed, terminate, weeds_serving
from kvbm.s3server.weed import MIN_FREE_SPACE


def ensure_running(
    dir: str | os.PathLike[str], *, port: int = 0, access_key: str = "kvbm",
    secret_key: str = "", bucket: str = "kvbm", startup_timeout_s: float = 60.0, min_free_space: str = MIN_FREE_SPACE,
) -> EmbeddedS3:
    """Reuse the SeaweedFS running from ``dir`` or start one as a background service (``kvbm serve``)."""
    s3 = EmbeddedS3(dir, port=port, access_key=access_key, secret_key=secret_key, bucket=bucket,
                    startup_timeout_s=startup_timeout_s, min_free_space=min_free_space)
    s3.start()
    s3.detach()
    return s3


def embedded_from_config(cfg: Any, bucket: str = "kvbm") -> EmbeddedS3:
    """``ensure_running`` for a :class:`kvbm.config.EmbeddedS3Config` (``dir`` empty: the cache dir)."""
    return ensure_running(embedded_dir(cfg), port=cfg.port, access_key=cfg.access_key, secret_key=cfg.secret_key,
                          bucket=bucket, min_free_space=f"{max(1, cfg.min_free_disk >> 20)}MiB")


def running_from_config(cfg: Any, bucket: str = "kvbm") -> EmbeddedS3 | None:
    """The embedded server of a :class:`kvbm.config.EmbeddedS3Config` if it already runs, else None (starts
    nothing: ``kvbm status``)."""
    s3 = EmbeddedS3(embedded_dir(cfg), port=cfg.port, access_key=cfg.access_key, secret_key=cfg.secret_key,
                    bucket=bucket)
    return s3 if s3.attach() else None


def embedded_dir(cfg: Any) -> str:
    """The data dir of a :class:`kvbm.config.EmbeddedS3Config` (``dir`` empty: ``<cache dir>/seaweedfs``)."""
    from kvbm.config import default_cache_dir

    return cfg.dir or str(default_cache_dir() / "seaweedfs")


def stop_dir(dir: str | os.PathLike[str], stop_timeout_s: float = 30.0) -> bool:
    """Stop the SeaweedFS running from ``dir`` (by its state file); True if one was running."""
    s3 = EmbeddedS3(dir, stop_timeout_s=stop_timeout_s)
    with st.dir_lock(s3.dir, stop_timeout_s + 60.0):
        state = st.read_state(s3.dir) or {}
        pid = state.get("pid")
        named = bool(pid) and pid_alive(pid) and pid_is_weed(pid)
        if named:
            s3.pid = pid
            s3.stop(reused_too=True)
        # Orphans on the dir (named by no state file) go too: nothing else would ever stop them.
        orphans = [p for p, _ in weeds_serving(s3.dir) if p != pid]
        for p in orphans:
            terminate(p, stop_timeout_s, None)
    return named or bool(orphans)
