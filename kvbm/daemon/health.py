"""Readiness of a daemon, from its stats snapshot (what ``/readyz`` answers)."""

from __future__ import annotations

from typing import Any

from kvbm.daemon.metrics import breaker_state


def readiness(snapshot: dict[str, Any] | None, serving: bool, index_bucket: str = "background") -> dict[str, Any]:
    """``{"ready": bool, "checks": {...}, "s3": {...} | None}``.

    Ready means: serving requests (the disk tier is indexed before the daemon serves), a configured prewarm
    (``daemon.prewarm_hottest``) finished, and, with an S3 tier,
    the bucket listed (``index_bucket: lazy`` lists per namespace, so it never waits) and its circuit
    breaker not open (an open breaker means the endpoint failed its last requests). ``snapshot`` is None
    while the daemon is not serving yet.
    """
    checks: dict[str, bool] = {"serving": serving}
    s3: dict[str, Any] | None = None
    if snapshot is not None and (snapshot.get("daemon") or {}).get("prewarm", "off") != "off":
        checks["prewarmed"] = snapshot["daemon"]["prewarm"] != "running"  # daemon.prewarm_hottest
    if snapshot is not None:
        tier = next((t for t in snapshot.get("tiers", []) if t.get("kind") == "s3"), None)
        if tier is not None:
            d = snapshot.get("daemon", {}) or {}
            state = breaker_state(tier)
            checks["bucket_indexed"] = bool(d.get("bucket_indexed")) or index_bucket == "lazy"
            checks["bucket_reachable"] = state != "open"
            raw = tier.get("breaker")
            s3 = {"endpoint": tier.get("endpoint"), "bucket": tier.get("bucket"), "breaker": state,
                  **({"breaker_detail": raw} if isinstance(raw, dict) else {})}
    return {"ready": all(checks.values()), "checks": checks, "s3": s3}
