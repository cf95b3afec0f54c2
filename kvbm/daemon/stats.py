"""The daemon's counters, shown by Stats and ``kvbm status`` (the manager has its own)."""

from __future__ import annotations

import msgspec


class DaemonStats(msgspec.Struct):
    requests: int = 0
    replies: int = 0
    dropped: int = 0
    shed: int = 0
    client_limited: int = 0  # requests answered `busy` because their client had its cap in flight
    deferred: int = 0  # requests whose start waited in their client's queue (kvbm.daemon.fairness)
    offload_seconds: float = 0.0
    onboard_seconds: float = 0.0
    lookup_seconds: float = 0.0
    events_published: int = 0
    prefetches: int = 0
    prefetch_blocks: int = 0
    prefetch_skipped: int = 0
    registered: int = 0
    expired_workers: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)
