"""The connector's daemon sessions: connect lazily, resolve the block geometry, degrade instead of failing."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient
from kvbm.client.lease import BAD_REQUEST, is_load
from kvbm.integrations.vllm.epoch import WeightsEpoch
from kvbm.integrations.vllm.geometry import K_SETTING, Geometry, MisconfiguredError, daemon_block_bytes, warn_once

log = logging.getLogger("kvbm.vllm")

# A reconnection to a daemon that is gone fails in about a millisecond (the client's socket monitor sees the
# refusal), so the link may retry often: 0.5 s, 1 s, ... 8 s.
RETRY_AFTER_S = 0.5
MAX_RETRY_AFTER_S = 8.0
# What a session with the daemon can fail with; each marks the link down (a miss or a recompute, never a raise).
LINK_ERRORS = (DaemonUnavailable, DaemonError, OSError)


def _now(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


class Link:
    """A daemon client that degrades instead of failing: errors mark it down for a few seconds.

    On connecting it resolves the block geometry against the daemon, then registers ``layout_of(k)``, named for
    the weights ``epoch`` when there is one: a link registered under an earlier epoch registers again before
    it is used (on the thread that uses it)."""

    def __init__(self, endpoint: str, geometry: Geometry, layout_of: Callable[[int], KVLayout], engine_id: str,
                 worker_id: str, timeout_s: float, client_kw: dict[str, Any] | None = None,
                 epoch: WeightsEpoch | None = None):
        self.endpoint, self.engine_id, self.worker_id = endpoint, engine_id, worker_id
        self.client_kw = client_kw or {}
        self.geometry, self.layout_of = geometry, layout_of
        self.layout: KVLayout | None = None
        self.timeout_s = timeout_s
        self.client: WorkerClient | None = None
        self.down_until = 0.0
        self.degraded_reason = ""
        self.misconfigured = False
        self.warned = False
        self.failures = 0
        self.epoch = epoch
        self.gen = -1  # the epoch generation the session registered under
        # False for a session whose pins another process reads (the scheduler's, for synchronous loads): dropped,
        # it does not Unregister, so the daemon keeps those pins until the session's lease runs out.
        self.unregister = True

    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reason)

    def get(self) -> WorkerClient | None:
        if self.client is not None:
            if self.epoch is None or self.gen == self.epoch.gen:
                return self.client
            self.drop()  # a new weights epoch: a new session under its namespace
        if time.monotonic() < self.down_until:
            return None
        # fail_fast: a daemon that dies is noticed when its socket drops, not after timeout_s.
        try:
            client = WorkerClient(self.endpoint, timeout_s=self.timeout_s, fail_fast=True, **self.client_kw)
        except Exception as e:  # a ZeroMQ error (EMFILE, a bad endpoint): this attempt fails, the link stays
            self.fail(e)
            return None
        # One epoch's generation and tag, read before the round trips: registered under that tag, the session is
        # that generation's (a change meanwhile re-registers at the next get, and no save of another is let in).
        gen, tag = self.epoch.snapshot() if self.epoch is not None else (-1, "")
        try:
            layout = WeightsEpoch.apply(self.layout_of(self.geometry.resolve(daemon_block_bytes(client))), tag)
            try:
                client.register(layout, worker_id=self.worker_id, engine_id=self.engine_id)
            except DaemonError as e:
                if e.code != BAD_REQUEST:
                    raise
                raise MisconfiguredError(f"kvbm: the daemon refused this engine's KV layout ({e.message}); "
                                         f"check the daemon's block_bytes and {K_SETTING}") from e
        except (MisconfiguredError, *LINK_ERRORS) as e:
            client.close()
            self.fail(e)
            return None
        except Exception as e:  # anything else (a G2 attach error, a layout bug) is an outage too, said as such
            log.warning("kvbm: connecting to %s failed unexpectedly: %r", self.endpoint, e)
            with contextlib.suppress(Exception):
                client.close()
            self.fail(e)
            return None
        self.client, self.layout, self.gen = client, layout, gen
        if self.degraded_reason:
            log.warning("kvbm: daemon %s is back", self.endpoint)
        self.degraded_reason = ""
        self.misconfigured = False
        self.warned = False
        self.failures = 0
        return client

    def drop_if_lost(self, dispose: Callable[..., Any] | None = None) -> bool:
        """Let the session go now if its daemon's connection dropped (seen without a request): with it goes the
        mapping of that daemon's G2 pool, whose memory a restarted daemon needs back, where this link's next
        request may never come (an idle engine; the engine's thread under async loads). On the thread that
        uses the link, as every other call; ``dispose(fn, *args)`` runs the unmapping elsewhere (the engine's
        thread hands it to another: unmapping a big pool, unregistering it from CUDA, takes milliseconds or more)."""
        c = self.client
        if c is None or not c.lost():
            return False
        self.fail(DaemonUnavailable(f"connection to {self.endpoint} lost"), dispose)
        return True

    def take(self) -> WorkerClient | None:
        """Forget the session and hand it over (the caller abandons it, on any thread: nothing here uses it again)."""
        c, self.client = self.client, None
        return c

    def error(self, e: BaseException) -> None:
        """A request on this link failed: the link goes down unless the daemon only said it is loaded."""
        if not is_load(e):
            self.fail(e)

    def fail(self, e: BaseException, dispose: Callable[..., Any] | None = None) -> None:
        """Mark the link down: its session is dropped (Unregister sent, not awaited; G2 unmapped; by
        ``dispose(fn, *args)`` when given)."""
        self.degraded_reason = f"{type(e).__name__}: {e}"
        # Back off so a daemon that stays away costs a reconnection attempt (a millisecond) now and then.
        self.failures += 1
        self.down_until = time.monotonic() + min(MAX_RETRY_AFTER_S, RETRY_AFTER_S * 2 ** (self.failures - 1))
        self.misconfigured = isinstance(e, MisconfiguredError)
        if self.misconfigured:
            # Not an outage: retried (the daemon may be reconfigured), but said once and as it is.
            self.degraded_reason = str(e)
            warn_once(str(e))
        elif not self.warned:
            log.warning("kvbm: daemon %s unavailable, recomputing instead (%s)", self.endpoint, e)
            self.warned = True
        # Unregister (a live daemon releases our pins and slots now rather than at the lease's end) and unmap G2; a
        # new socket next time, so a late reply is never read as the next one.
        c = self.take()
        if c is not None:
            (dispose or _now)(c.abandon, self.unregister)

    def drop(self) -> None:
        """Forget the session without waiting on the daemon (Unregister sent unless ``unregister`` is False)."""
        if self.client is not None:
            self.client.abandon(self.unregister)
            self.client = None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


@dataclass(frozen=True)
class Links:
    """What every link of one engine shares; :meth:`open` makes the link of one worker rank and role."""

    endpoint: str
    geometry: Geometry
    engine_id: str
    timeout_s: float
    layout_of: Callable[[int, int], KVLayout]  # (rank, k) -> that worker's layout for kvbm blocks of k
    client_kw: dict[str, Any] = field(default_factory=dict)
    epoch: WeightsEpoch | None = None  # the process's weights epoch, shared by its links

    def open(self, rank: int, worker_id: str, map_g2: bool = True) -> Link:
        """The link of worker ``rank`` (``pp_rank * tp_size + tp_rank``); ``map_g2`` False for one that never
        copies (the scheduler's: it pins, the worker copies)."""
        return Link(self.endpoint, self.geometry, lambda k: self.layout_of(rank, k), self.engine_id,
                    f"{self.engine_id}-{worker_id}", self.timeout_s, {**self.client_kw, "map_g2": map_g2},
                    self.epoch)
