"""Background failures (cascades, demotions): counted per ``tier:ExceptionType``, logged sparingly."""

from __future__ import annotations

import logging
import time

from kvbm.blocks import BlockKey
from kvbm.errors import KvbmError

log = logging.getLogger("kvbm.manager")

FAILURE_LOG_EVERY_S = 60.0  # after the first, a kind of failure is logged at most this often


class FailureLog:
    """Counts background failures per ``tier:ExceptionType`` and logs each kind once, then at most once
    every ``every_s`` (with how many were not logged), so an outage is one line, not one per block."""

    def __init__(self, counts: dict[str, int], every_s: float = FAILURE_LOG_EVERY_S) -> None:
        self.counts = counts
        self.every_s = every_s
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (when, count then)

    def record(self, what: str, key: BlockKey, tier: str, e: BaseException) -> None:
        kind = f"{tier}:{type(e).__name__}"
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        now = time.monotonic()
        last = self._logged.get(kind)
        if last is not None and now - last[0] < self.every_s:
            return
        self._logged[kind] = (now, n)
        since = "" if last is None else f" ({n - last[1] - 1} more like it not logged)"
        log.warning("%s of %s to %s failed: %s: %s%s", what, key, tier, type(e).__name__, e, since,
                    exc_info=not isinstance(e, (KvbmError, OSError)))
