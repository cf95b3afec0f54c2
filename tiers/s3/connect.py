"""Bringing an S3 endpoint online: the bucket check (or creation) and the start of the http and NIXL body
clients, each proven with a real write + read before it carries blocks (:class:`~kvbm.tiers.s3.session.S3Session`
calls them)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kvbm.blocks import BlockKey
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.tiers.s3.codes import CRED_CODES, error_code, one_line, probe_failure
from kvbm.tiers.s3.http import HttpBodyClient
from kvbm.tiers.s3.nixl import NixlObj

log = logging.getLogger("kvbm.tiers.s3")


class S3Endpoint(Protocol):
    """What these functions read of the session."""

    cfg: S3Config
    endpoint: str | None
    bucket: str

    @property
    def endpoint_name(self) -> str: ...
    @property
    def base(self) -> str: ...
    @property
    def client(self) -> Any: ...
    async def credential_source(self, session: Any, what: str) -> Callable[[], Awaitable[Any]]: ...
    async def diagnose(self) -> str: ...


async def check_bucket(s: S3Endpoint) -> None:
    """The bucket answers (or is created): outages raise TierUnavailableError, misconfiguration ConfigError."""
    import botocore.exceptions as bex

    where = s.endpoint_name
    try:
        await s.client.list_objects_v2(Bucket=s.bucket, MaxKeys=1)
        return
    except bex.NoCredentialsError:
        raise ConfigError(
            f"no S3 credentials for {where}: set s3.access_key/s3.secret_key, AWS_* env or an AWS profile"
        ) from None
    except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
            bex.ConnectionClosedError) as e:
        raise TierUnavailableError(f"S3 endpoint {where} unreachable: {one_line(e)}") from None
    except bex.ClientError as e:
        code = error_code(e)
        if code in CRED_CODES:
            raise ConfigError(f"S3 credentials rejected by {where} ({code})") from None
        if code in ("AccessDenied", "403", "Forbidden"):
            raise ConfigError(f"S3 access to bucket {s.bucket!r} denied by {where} ({code})") from None
        if code not in ("NoSuchBucket", "404"):
            raise TierUnavailableError(f"S3 endpoint {where}: {code}: {one_line(e)}") from None
    except bex.BotoCoreError as e:
        raise TierUnavailableError(f"S3 endpoint {where}: {one_line(e)}") from None
    # The bucket does not exist.
    if not s.cfg.create_bucket:
        raise ConfigError(f"S3 bucket {s.bucket!r} does not exist at {where} (s3.create_bucket is false)")
    try:
        kw: dict[str, Any] = {"Bucket": s.bucket}
        if s.endpoint is None and s.cfg.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": s.cfg.region}
        await s.client.create_bucket(**kw)
    except bex.ClientError as e:
        if error_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ConfigError(
                f"cannot create S3 bucket {s.bucket!r} at {where}: {error_code(e)}: {one_line(e)}"
            ) from None
    log.info("created S3 bucket %s at %s", s.bucket, where)


async def start_http(s: S3Endpoint, session: Any) -> HttpBodyClient:
    """The http body client, proven with a real write + read (its own signer, its own connections)."""
    creds = await s.credential_source(session, s.endpoint_name)
    try:
        client = HttpBodyClient(s.cfg, s.endpoint, s.bucket, creds)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    probe = f"{s.base}.kvbm-probe/{uuid.uuid4().hex}"
    pkey = BlockKey("kvbm-probe-0000000000000000", uuid.uuid4().bytes)
    body = b"kvbm-http-probe"
    try:
        await client.put(probe, pkey, memoryview(body), {})
        back = bytearray(len(body))
        if await client.get_into(probe, pkey, memoryview(back)) != len(body) or bytes(back) != body:
            raise TierUnavailableError("probe read back different bytes")
    except Exception as e:
        client.close()
        raise probe_failure(s.endpoint_name, "S3 http client", error_code(e), e) from None
    finally:
        with contextlib.suppress(Exception):
            await s.client.delete_object(Bucket=s.bucket, Key=probe)
    return client


async def start_nixl(s: S3Endpoint, session: Any) -> NixlObj:
    """The NIXL OBJ backend for ``s``, started and its credentials proven with a real write + read."""
    source = await s.credential_source(session, f"the NIXL OBJ backend ({s.endpoint_name})")
    obj = NixlObj(s.cfg, s.endpoint, s.bucket, source)  # asks the source again before each transfer
    await obj.start()
    # create_backend accepts any secret; prove the credentials with a real write + read.
    probe = f"{s.base}.kvbm-probe/{uuid.uuid4().hex}"
    body = b"kvbm-nixl-probe"
    try:
        await obj.write(probe, body)
        back = bytearray(len(body))
        await obj.read(probe, memoryview(back))
        if bytes(back) != body:
            raise TierUnavailableError("NIXL OBJ probe read back different bytes")
    except TierUnavailableError as e:
        obj.close()
        raise probe_failure(s.endpoint_name, "NIXL OBJ backend", await s.diagnose(), e) from None
    except BaseException:
        obj.close()
        raise
    finally:
        with contextlib.suppress(Exception):
            await s.client.delete_object(Bucket=s.bucket, Key=probe)
    return obj
