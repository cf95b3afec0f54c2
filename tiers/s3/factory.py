"""make_s3_tier: an S3Tier for a config, with credentials from the arguments, the config or the environment."""

from __future__ import annotations

import os
from typing import Any

from kvbm.config import S3Config
from kvbm.tiers.s3.tier import S3Tier


def make_s3_tier(
    cfg: S3Config,
    endpoint: str | None = None,
    credentials: tuple[str, ...] | None = None,
    **kw: Any,
) -> S3Tier:
    """An S3Tier for ``cfg``. ``endpoint`` overrides ``cfg.endpoint`` (e.g. the embedded SeaweedFS).
    Credentials: ``credentials`` (access, secret[, token]) if given, else ``cfg.access_key``/``secret_key``,
    else ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` from the environment, else the AWS credential chain
    (resolved by botocore when the tier starts)."""
    ak = sk = tok = None
    if credentials:
        ak, sk = credentials[0], credentials[1]
        tok = credentials[2] if len(credentials) > 2 else None
    elif cfg.access_key and cfg.secret_key:
        ak, sk, tok = cfg.access_key, cfg.secret_key, cfg.session_token or None
    elif os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        ak, sk = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
        tok = os.environ.get("AWS_SESSION_TOKEN") or None
    return S3Tier(cfg, endpoint=endpoint or cfg.endpoint or None, access_key=ak, secret_key=sk,
                  session_token=tok, **kw)
