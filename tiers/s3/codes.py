"""S3 error codes: which mean a miss, which mean bad credentials, and errors as one short line."""

from __future__ import annotations

_CRED_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "InvalidToken",
               "ExpiredToken"}
_MISS_CODES = {"NoSuchKey", "404", "NotFound"}


def _err_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        code = str(err.get("Code") or "")
        if not code:
            code = str((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or "")
        return code
    return ""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__
