"""S3 error codes: which mean a miss, which mean bad credentials, and errors as one short line."""

from __future__ import annotations

from kvbm.errors import ConfigError, KvbmError, TierUnavailableError

CRED_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "InvalidToken",
               "ExpiredToken"}
MISS_CODES = {"NoSuchKey", "404", "NotFound"}


def error_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        code = str(err.get("Code") or "")
        if not code:
            code = str((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or "")
        return code
    return ""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def probe_failure(endpoint: str, backend: str, code: str, e: BaseException) -> KvbmError:
    """What a body backend's start-up probe (a real write + read) raises: rejected credentials are
    misconfiguration (ConfigError, the start fails), anything else leaves the tier unreachable."""
    if code in CRED_CODES:
        return ConfigError(f"S3 credentials rejected by {endpoint} ({code}, {backend})")
    return TierUnavailableError(f"{backend} cannot use {endpoint}: {one_line(e)}")
