"""Exceptions shared across kvbm."""


class KvbmError(Exception):
    """Base class for kvbm errors."""


class ConfigError(KvbmError):
    """A configuration value is missing or invalid; the message names the field."""


class TierFullError(KvbmError):
    """A tier has no room for a block even after eviction."""


class CorruptBlockError(KvbmError):
    """A stored block failed its integrity checks; callers treat it as a miss."""


class TierUnavailableError(KvbmError):
    """A tier's backing store (e.g. the S3 endpoint) cannot be reached right now."""


class WriteShedError(TierUnavailableError):
    """A tier refused a write without attempting it (circuit breaker open, too many writes in flight, or
    the endpoint not reachable yet). Nothing was stored; the refusal is counted in the tier's ``stats.shed``."""
