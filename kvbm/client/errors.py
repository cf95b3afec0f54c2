"""The daemon clients' errors (:mod:`kvbm.client`): the lowest module of the package, so every other imports it."""

from __future__ import annotations

from kvbm.errors import KvbmError


class DaemonUnavailable(KvbmError):
    """The daemon did not answer in time (not running, overloaded, or unreachable)."""


class DaemonError(KvbmError):
    """The daemon answered with an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Overloaded(DaemonError):
    """The daemon shed an offload; retry later (``retry_after_ms``)."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__("shed", f"daemon overloaded, retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms
