"""Whether an S3 endpoint is ready for kvbm: a synchronous client and one authenticated PUT into the
bucket (creating the bucket first)."""

from __future__ import annotations

from typing import Any

PROBE_KEY = ".kvbm-ready"


def s3_client(endpoint: str, access_key: str, secret_key: str, timeout: float = 5.0) -> Any:
    """A synchronous botocore S3 client (botocore comes with aiobotocore; boto3 is not needed)."""
    import botocore.config
    import botocore.session

    session = botocore.session.get_session()
    return session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1},
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        ),
    )


def probe_put(client: Any, bucket: str) -> tuple[bool, str]:
    """Create ``bucket`` (if needed) and PUT a probe object; (ok, what went wrong)."""
    import botocore.exceptions as bex

    try:
        try:
            client.create_bucket(Bucket=bucket)
        except bex.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        client.put_object(Bucket=bucket, Key=PROBE_KEY, Body=b"ok")
        return True, "ok"
    except bex.ClientError as e:
        err = e.response.get("Error", {})
        code = err.get("Code", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return False, f"credentials rejected ({code})"
        return False, f"{code}: {err.get('Message', '')}"
    except (bex.BotoCoreError, OSError) as e:
        return False, type(e).__name__
