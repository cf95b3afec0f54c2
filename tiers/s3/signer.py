"""The aiobotocore client's SigV4 signer that signs headers and URL but never hashes the body (the S3 tier
checks every block's own checksum instead); over plain http botocore would hash every payload with SHA-256."""

from __future__ import annotations

from typing import Any

UNSIGNED_SIGV4 = "s3v4-kvbm-unsigned-payload"


def register_unsigned_signer() -> None:
    """A SigV4 signer that never hashes the body (headers and URL are still signed)."""
    import botocore.auth

    if UNSIGNED_SIGV4 in botocore.auth.AUTH_TYPE_MAPS:
        return

    class UnsignedPayloadS3SigV4Auth(botocore.auth.S3SigV4Auth):
        def _should_sha256_sign_payload(self, request: Any) -> bool:
            return False

    botocore.auth.AUTH_TYPE_MAPS[UNSIGNED_SIGV4] = UnsignedPayloadS3SigV4Auth
