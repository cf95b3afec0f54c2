"""The NIXL agents kvbm runs in-process: the probe (which python package imports), agent creation and
the post-and-poll wait every NIXL transfer goes through."""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any

from kvbm.errors import KvbmError

_XFER_TIMEOUT_S = 120.0
log = logging.getLogger("kvbm.transfer")
_ids = itertools.count()
_pumps: weakref.WeakSet[ProgressPump] = weakref.WeakSet()  # running ones, stopped at exit (see ProgressPump)


class TransferBackendError(KvbmError):
    """The requested transfer backend cannot be used (NIXL missing, a backend failed to create)."""


def nixl_modules() -> tuple[str, ...]:
    """The NIXL packages to try, in order: the build matching torch's CUDA major first (the ``cu12``/``cu13``
    extras install one of them), then the other, then the ``nixl`` meta package."""
    try:
        import torch

        cuda = torch.version.cuda or ""
    except ImportError:
        cuda = ""
    order = ("nixl_cu13", "nixl_cu12") if cuda.startswith("13") else ("nixl_cu12", "nixl_cu13")
    return (*order, "nixl")


def nixl_api() -> Any:
    """The ``_api`` module of the first NIXL package that imports (see :func:`nixl_modules`)."""
    errors: list[str] = []
    for mod in nixl_modules():
        try:
            return __import__(f"{mod}._api", fromlist=["nixl_agent"])
        except Exception as e:  # ImportError, or a missing shared library raising OSError
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    raise ImportError("no NIXL package imports (install kvbm[cu12] or kvbm[cu13], matching torch's CUDA): "
                      + "; ".join(errors))


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
            "install kvbm[cu12] or kvbm[cu13] (matching torch's CUDA) or set transfer.backend to 'auto' or 'plain'"
        )
    return nixl_api()


def new_agent(api: Any, prefix: str, backend: str) -> Any:
    """An agent with ``backend`` and strict thread sync (several io threads share it), without NIXL's progress
    thread: UCX's polled the worker without pause and burned a whole core per agent while idle (measured here:
    1.0 core; two daemons with peer reads took half of a 2-core engine's CPU). The initiator progresses its own
    transfers (:func:`wait_xfer`); an agent others read from or connect to runs a :class:`ProgressPump`."""
    cfg = api.nixl_agent_config(
        backends=[], enable_prog_thread=False, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = api.nixl_agent(f"{prefix}-{os.getpid()}-{next(_ids)}", cfg)
    agent.create_backend(backend)
    return agent


class ProgressPump:
    """Progresses a passive agent's backend every ``period_s`` on a thread of its own: UCX's connection set-up
    (wireup) and, over TCP, a peer's READs need the target's worker to run. ``get_new_notifs`` is NIXL's call that
    progresses a backend without a thread; 1 ms costs ~3% of a core and adds at most that to a first contact.

    A pump its owner never stopped is stopped at interpreter exit (``atexit``, before finalization): a daemon
    thread still inside ``get_new_notifs`` then (the GIL released in a C++ frame) is unwound by ``pthread_exit``
    when it takes the GIL back, through a ``noexcept`` frame: ``std::terminate``, the process aborts (rc 134)."""

    PERIOD_S = 0.001

    ERROR_BACKOFF_S = 0.1  # after a failed progress call: a broken agent is not asked 1,000 times a second

    def __init__(self, agent: Any, name: str, period_s: float = PERIOD_S) -> None:
        self._agent, self._period, self.name = agent, period_s, name
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _pumps.add(self)

    def _run(self) -> None:
        wait = self._period
        while not self._stop.wait(wait):
            try:
                self._agent.get_new_notifs()
                wait = self._period
            except Exception as e:  # a transfer that meets the error reports it; the pump goes on, slower
                self.errors += 1
                if self.errors == 1:
                    log.warning("kvbm: NIXL progress of %s failed (%s); retried every %.0f ms", self.name, e,
                                self.ERROR_BACKOFF_S * 1e3)
                wait = self.ERROR_BACKOFF_S

    def stop(self) -> None:
        """Stop and join (at most 5 s: a progress call stuck in the backend must not hang a daemon's exit)."""
        self._stop.set()
        _pumps.discard(self)
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)


@atexit.register
def _stop_pumps() -> None:
    for pump in list(_pumps):
        pump.stop()


def wait_xfer(agent: Any, handle: Any, what: str, timeout_s: float = _XFER_TIMEOUT_S) -> None:
    """Post ``handle`` and poll until DONE; raise on ERR or after ``timeout_s``. Releases the handle."""
    try:
        try:
            state = agent.transfer(handle)
        except Exception as e:
            raise OSError(errno.EIO, f"NIXL {what} transfer failed: {e}") from e
        deadline = time.monotonic() + timeout_s
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
                    raise TransferBackendError(f"NIXL {what} did not finish in {timeout_s:.3g} s")
        if state == "ERR":
            raise OSError(errno.EIO, f"NIXL {what} transfer failed")
    finally:
        agent.release_xfer_handle(handle)

