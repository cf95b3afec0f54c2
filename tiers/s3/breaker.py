"""The S3 tier's circuit breaker: fail fast while the endpoint is down, probe it again after a pause."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("kvbm.tiers.s3")


class CircuitBreaker:
    """closed -> (``failures`` in a row) -> open -> (``reset_s``) -> half-open -> one probe -> closed/open."""

    def __init__(self, failures: int, reset_s: float, clock: Any = time.monotonic) -> None:
        self.failures = max(1, failures)
        self.reset_s = reset_s
        self.clock = clock
        self.state = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.opens = 0
        self._probing = False

    def would_allow(self) -> bool:
        """Whether :meth:`allow` would let a request through now (without changing the state)."""
        if self.state == "closed":
            return True
        if self.state == "open":
            return self.clock() - self.opened_at >= self.reset_s
        return not self._probing

    def trip(self, why: str) -> None:
        """Open now (e.g. the endpoint is unreachable at start), whatever the count."""
        if self.state != "open":
            log.warning("S3 circuit breaker open: %s", why)
            self.opens += 1
        self.state = "open"
        self.opened_at = self.clock()
        self._probing = False

    def describe(self) -> dict[str, object]:
        return {"state": self.state, "opens": self.opens, "consecutive": self.consecutive}

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open":
            if self.clock() - self.opened_at < self.reset_s:
                return False
            self.state = "half-open"
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def abandon(self) -> None:
        """The request let through as the half-open probe was cancelled: it proved nothing, so the next request
        may probe (neither a success nor a failure)."""
        self._probing = False

    def success(self) -> None:
        if self.state != "closed":
            log.info("S3 circuit breaker closed: endpoint answers again")
        self.state = "closed"
        self.consecutive = 0
        self._probing = False

    def failure(self) -> None:
        self.consecutive += 1
        if self.state == "half-open" or (self.state == "closed" and self.consecutive >= self.failures):
            if self.state == "closed":
                log.warning("S3 circuit breaker open after %d failures; retry in %.1fs",
                            self.consecutive, self.reset_s)
            self.state = "open"
            self.opened_at = self.clock()
            self.opens += 1
            self._probing = False
