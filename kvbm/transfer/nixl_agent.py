"""The NIXL agents kvbm runs in-process: the probe (which python package imports), agent creation and
the post-and-poll wait every NIXL transfer goes through."""

from __future__ import annotations

import errno
import functools
import itertools
import os
import time
from typing import Any

from kvbm.errors import KvbmError

_XFER_TIMEOUT_S = 120.0
_ids = itertools.count()


class TransferBackendError(KvbmError):
    """The requested transfer backend cannot be used (NIXL missing, a backend failed to create)."""


def nixl_api() -> Any:
    """The nixl ``_api`` module: the cu12 wheel first (the pinned one), then the meta package, then cu13."""
    last: Exception | None = None
    for mod in ("nixl_cu12._api", "nixl._api", "nixl_cu13._api"):
        try:
            return __import__(mod, fromlist=["nixl_agent"])
        except Exception as e:  # ImportError, or a missing shared library raising OSError
            last = e
    raise ImportError(f"no NIXL python package imports ({last})")


@functools.lru_cache(maxsize=1)
def nixl_available() -> tuple[bool, str]:
    """(True, module name) when NIXL imports and an agent creates here, else (False, why). Cached."""
    try:
        api = nixl_api()
        api.nixl_agent(f"kvbm-probe-{os.getpid()}", api.nixl_agent_config(backends=[]))
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    return True, api.__name__


def require_nixl() -> Any:
    ok, reason = nixl_available()
    if not ok:
        raise TransferBackendError(
            f"transfer.backend is 'nixl' but NIXL is unavailable ({reason}); "
            "install nixl-cu12 or set transfer.backend to 'auto' or 'plain'"
        )
    return nixl_api()


def new_agent(api: Any, prefix: str, backend: str) -> Any:
    """An agent with ``backend`` and strict thread sync (several io threads share it)."""
    cfg = api.nixl_agent_config(
        backends=[], enable_prog_thread=True, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = api.nixl_agent(f"{prefix}-{os.getpid()}-{next(_ids)}", cfg)
    agent.create_backend(backend)
    return agent


def wait_xfer(agent: Any, handle: Any, what: str) -> None:
    """Post ``handle`` and poll until DONE; raise on ERR or timeout. Releases the handle."""
    try:
        try:
            state = agent.transfer(handle)
        except Exception as e:
            raise OSError(errno.EIO, f"NIXL {what} transfer failed: {e}") from e
        deadline = time.monotonic() + _XFER_TIMEOUT_S
        spins = 0
        while state not in ("DONE", "ERR"):
            try:
                state = agent.check_xfer_state(handle)
            except Exception as e:  # nixlBackendError: the backend reports the failure by raising
                raise OSError(errno.EIO, f"NIXL {what} transfer failed: {e}") from e
            spins += 1
            if spins > 64:
                time.sleep(2e-5)  # don't hog one of few cores while a long transfer runs
                if time.monotonic() > deadline:
                    raise TransferBackendError(f"NIXL {what} did not finish in {_XFER_TIMEOUT_S:.0f} s")
        if state == "ERR":
            raise OSError(errno.EIO, f"NIXL {what} transfer failed")
    finally:
        agent.release_xfer_handle(handle)

