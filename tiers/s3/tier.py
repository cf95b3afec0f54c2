"""G4: S3-compatible object storage (AWS S3, SeaweedFS, MinIO, ...).

Key scheme
----------
One object per block::

    {prefix}/{namespace}/{hash_hex[:shard_chars]}/{hash_hex}

``namespace`` is ``BlockKey.namespace`` (``<model-slug>-<16 hex layout fingerprint>``), ``hash_hex`` the
block hash in hex. The shard directory spreads keys over ``16**shard_chars`` prefixes (S3 partitions
request rates per prefix); with ``shard_chars: 0`` it is left out, and an empty ``prefix`` drops the
leading component. Keys under the prefix that do not parse this way are foreign and left alone.

Object format
-------------
The body is :func:`kvbm.blocks.encode_block` (a 128-byte integrity header, then the payload), so the
payload length is ``object size - 128``. Objects written by the http and aiobotocore paths also carry user metadata
(``x-amz-meta-kvbm-format``, ``-kvbm-namespace``, ``-kvbm-hash``, ``-kvbm-nbytes``, ``-kvbm-created``)
so that listing tools need not read bodies; the NIXL OBJ path cannot set metadata, and the tools fall
back to the key and size. Every read is verified with ``decode_block``; a corrupt object is a miss, is
counted in ``stats.corrupt`` and is deleted.

Data paths (``s3.client``)
--------------------------
* ``aiobotocore``: one shared client, at most ``max_concurrency`` requests in flight.
* ``http``: :mod:`kvbm.tiers.s3.http`, plain keep-alive HTTP(S) connections in worker threads that read
  straight into the caller's buffer and send the payload from it (no body copy), checksumming there.
* ``nixl``: the NIXL OBJ backend (aws-sdk-cpp) moves block bodies; its blocking calls run in a private
  thread pool.

``http`` and ``nixl`` are :class:`~kvbm.tiers.s3.http.BodyBackend` implementations (``self._body``); control
calls (bucket checks, HEAD, LIST, DELETE) always use aiobotocore.

Failure handling
----------------
A circuit breaker opens after ``breaker_failures`` consecutive failures: for ``breaker_reset_s`` reads
are misses without I/O and writes are shed; then one probe request is let through (half-open) and a
success closes it again. Writes beyond ``max_pending_writes`` in flight are shed too. A write that did not
happen always raises, so no caller mistakes it for a stored block: a shed write raises
:class:`~kvbm.errors.WriteShedError` (counted in ``stats.shed``), a failed one
:class:`~kvbm.errors.TierUnavailableError` (counted in ``stats.errors``).

With ``wait_for_endpoint`` (the daemon) an endpoint that cannot be reached at start is an outage, not an
error: the tier starts *offline* (breaker open, reads miss, writes shed, listings raise) and a background
task re-probes the bucket with backoff until it answers, then brings the tier online. Misconfiguration
(rejected credentials, a missing bucket that may not be created) still fails the start. Credentials are
never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as _dt
import html
import itertools
import logging
import os
import re
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbm.blocks import (
    FORMAT_VERSION,
    MIN_HEADER_LEN,
    BlockKey,
    decode_block,
    encode_block_into,
    unpack_header,
    verify,
)
from kvbm.config import S3Config, parse_size
from kvbm.errors import ConfigError, CorruptBlockError, TierFullError, TierUnavailableError, WriteShedError
from kvbm.keys import is_namespace, object_relkey, parse_object_relkey
from kvbm.metrics import no_observe
from kvbm.tiers.base import StoredBlock, Tier, TierStats
from kvbm.tiers.s3.http import BodyBackend, HttpBodyClient

log = logging.getLogger("kvbm.tiers.s3")

HEADER_LEN = MIN_HEADER_LEN
META_FORMAT = f"kvbm-block-v{FORMAT_VERSION}"
_CRED_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidClientTokenId", "InvalidToken",
               "ExpiredToken"}
_MISS_CODES = {"NoSuchKey", "404", "NotFound"}
DELETE_CHUNK = 1000
# Checksums of bodies this large run in a thread, not on the event loop.
_OFFLOOP_BYTES = 256 * 1024
LIST_PAGE = 1000  # keys per LIST page (the S3 maximum)
LIST_SERIAL_PAGES = 4  # pages of a namespace listed serially before it is split by shard directory


UNSIGNED_SIGV4 = "s3v4-kvbm-unsigned-payload"


def _register_unsigned_signer() -> None:
    """A SigV4 signer that never hashes the body (headers and URL are still signed)."""
    import botocore.auth

    if UNSIGNED_SIGV4 in botocore.auth.AUTH_TYPE_MAPS:
        return

    class UnsignedPayloadS3SigV4Auth(botocore.auth.S3SigV4Auth):
        def _should_sha256_sign_payload(self, request: Any) -> bool:
            return False

    botocore.auth.AUTH_TYPE_MAPS[UNSIGNED_SIGV4] = UnsignedPayloadS3SigV4Auth


async def _read_exact(stream: Any, dst: memoryview, key: BlockKey) -> None:
    """Fill ``dst`` from a response body, copying each received chunk once."""
    pos, n = 0, dst.nbytes
    while pos < n:
        chunk = await stream.read(n - pos)
        if not chunk:
            raise CorruptBlockError(f"{key}: object truncated ({pos} of {n} bytes)")
        dst[pos : pos + len(chunk)] = chunk
        pos += len(chunk)


class CircuitBreaker:
    """closed -> (``failures`` in a row) -> open -> (``reset_s``) -> half-open -> one probe -> closed/open."""

    def __init__(self, failures: int, reset_s: float, clock: Any = time.monotonic) -> None:
        self.failures = max(1, failures)
        self.reset_s = reset_s
        self.clock = clock
        self.state = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.opens = 0
        self._probing = False

    def would_allow(self) -> bool:
        """Whether :meth:`allow` would let a request through now (without changing the state)."""
        if self.state == "closed":
            return True
        if self.state == "open":
            return self.clock() - self.opened_at >= self.reset_s
        return not self._probing

    def trip(self, why: str) -> None:
        """Open now (e.g. the endpoint is unreachable at start), whatever the count."""
        if self.state != "open":
            log.warning("S3 circuit breaker open: %s", why)
            self.opens += 1
        self.state = "open"
        self.opened_at = self.clock()
        self._probing = False

    def describe(self) -> dict[str, object]:
        return {"state": self.state, "opens": self.opens, "consecutive": self.consecutive}

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open":
            if self.clock() - self.opened_at < self.reset_s:
                return False
            self.state = "half-open"
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        if self.state != "closed":
            log.info("S3 circuit breaker closed: endpoint answers again")
        self.state = "closed"
        self.consecutive = 0
        self._probing = False

    def failure(self) -> None:
        self.consecutive += 1
        if self.state == "half-open" or (self.state == "closed" and self.consecutive >= self.failures):
            if self.state == "closed":
                log.warning("S3 circuit breaker open after %d failures; retry in %.1fs",
                            self.consecutive, self.reset_s)
            self.state = "open"
            self.opened_at = self.clock()
            self.opens += 1
            self._probing = False


def _fast_timestamp(value: Any) -> Any:
    """botocore's timestamp parser, with ISO 8601 (what S3 LIST returns) parsed by ``datetime.fromisoformat``."""
    if isinstance(value, str) and len(value) >= 20 and value[4] == "-" and value[10] == "T":
        try:
            dt = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if dt.tzinfo is not None:
                return dt
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)


# Set only around S3Tier._list_pages' own requests: other callers of the client get botocore's usual reply.
_FAST_LIST: contextvars.ContextVar[bool] = contextvars.ContextVar("kvbm_fast_list", default=False)
_CONTENTS_RE = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_KEY_RE = re.compile(rb"<Key>(.*?)</Key>", re.S)
_SIZE_RE = re.compile(rb"<Size>(\d+)</Size>")
_MTIME_RE = re.compile(rb"<LastModified>([^<]*)</LastModified>")


def _fast_list_contents(response_dict: dict[str, Any], customized_response_dict: dict[str, Any], **_: Any) -> None:
    """Parse a ListObjectsV2 page's ``<Contents>`` here (a few regex matches per object) and hand botocore the
    page without them: its generic XML-to-dict parser costs ~50 us per object, the bulk of the client CPU
    of a million-object listing. The entries go to ``KvbmContents`` as ``(key, size, last-modified text)``."""
    body = response_dict.get("body")
    if not _FAST_LIST.get() or response_dict.get("status_code") != 200 or not isinstance(body, bytes | bytearray):
        return
    if b"<Contents>" not in body:
        return
    # botocore asks for EncodingType=url and decodes the keys after parsing; do the same here.
    url = b"<EncodingType>url</EncodingType>" in body
    out = []
    for m in _CONTENTS_RE.finditer(body):
        c = m.group(1)
        k, size, mtime = _KEY_RE.search(c), _SIZE_RE.search(c), _MTIME_RE.search(c)
        if k is None:
            return  # not a page this parser understands: leave it all to botocore
        key = k.group(1).decode()
        if "&" in key:
            key = html.unescape(key)
        if url and ("%" in key or "+" in key):
            key = urllib.parse.unquote_plus(key)  # as botocore's decode_list_object_v2
        out.append((key, int(size.group(1)) if size else 0, mtime.group(1).decode() if mtime else ""))
    customized_response_dict["KvbmContents"] = out
    response_dict["body"] = _CONTENTS_RE.sub(b"", body)


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


class S3Stats(TierStats):
    """The tier's counters plus HEAD requests (existence probes, listing tools)."""

    heads: int = 0


class S3Tier(Tier):
    """Blocks as objects in one bucket; see the module docstring for keys, format and failure handling."""

    name = "G4"
    kind = "s3"

    def __init__(
        self,
        cfg: S3Config | None = None,
        *,
        endpoint: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        capacity_bytes: int | None = None,
        bucket: str | None = None,
        prefix: str | None = None,
        client: str | None = None,
        wait_for_endpoint: bool = False,
    ) -> None:
        cfg = cfg or S3Config()
        cap = parse_size(cfg.capacity, "s3.capacity") if capacity_bytes is None else capacity_bytes
        super().__init__(cap)
        self.stats: S3Stats = S3Stats()
        self.cfg = cfg
        self.endpoint = endpoint if endpoint is not None else (cfg.endpoint or None)
        self.bucket = bucket if bucket is not None else cfg.bucket
        self.prefix = (prefix if prefix is not None else cfg.prefix).strip("/")
        self.client_kind = client or cfg.client
        if self.client_kind not in ("aiobotocore", "http", "nixl"):
            raise ConfigError(f"s3.client: {self.client_kind!r} is not 'aiobotocore', 'http' or 'nixl'")
        if len(self.bucket) < 3:
            raise ConfigError(f"s3.bucket: {self.bucket!r} is shorter than 3 characters")
        self.shard_chars = cfg.shard_chars
        self._access_key = access_key if access_key is not None else (cfg.access_key or None)
        self._secret_key = secret_key if secret_key is not None else (cfg.secret_key or None)
        self._session_token = session_token if session_token is not None else (cfg.session_token or None)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self.observe = no_observe  # (op, seconds) per successful request; see kvbm.metrics
        self._index: dict[BlockKey, int] = {}
        self._used = 0
        self._pending_writes = 0
        self._bodies: dict[int, list[bytearray]] = {}
        self._sem: asyncio.Semaphore | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: Any = None
        self._nixl: _NixlObj | None = None
        self._body: BodyBackend | None = None  # block bodies (http, nixl); None: aiobotocore
        self._started = False
        self._warned_at = 0.0
        # Offline: started, but the endpoint has not answered yet (only with wait_for_endpoint).
        self.wait_for_endpoint = wait_for_endpoint
        self.online = False
        self.last_error = ""
        self._prober: asyncio.Task[None] | None = None

    # -- naming ----------------------------------------------------------------------------------
    @property
    def endpoint_name(self) -> str:
        return self.endpoint or "AWS S3"

    def _base(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def object_key(self, key: BlockKey) -> str:
        return f"{self._base()}{object_relkey(key, self.shard_chars)}"

    def parse_key(self, s3_key: str) -> BlockKey | None:
        """The BlockKey an object key names, or None for a key this scheme did not write."""
        base = self._base()
        if not s3_key.startswith(base):
            return None
        return parse_object_relkey(s3_key[len(base) :], self.shard_chars)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        import aiobotocore.session
        from aiobotocore.config import AioConfig

        cfg = self.cfg
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._stack = contextlib.AsyncExitStack()
        session = aiobotocore.session.get_session()
        # LIST pages carry one ISO 8601 timestamp per object; botocore parses them with dateutil (~0.3 ms each,
        # most of a million-object listing's client CPU). The C parser does it in a microsecond.
        session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_fast_timestamp)
        aio_cfg = AioConfig(
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"max_attempts": max(0, cfg.max_retries) + 1, "mode": "standard"},
            max_pool_connections=max(10, cfg.max_concurrency * 2),
            s3={"addressing_style": cfg.addressing},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        if not cfg.sign_payload:
            _register_unsigned_signer()
            aio_cfg = aio_cfg.merge(AioConfig(signature_version=UNSIGNED_SIGV4))
        kwargs: dict[str, Any] = {"region_name": cfg.region, "config": aio_cfg}
        if self.endpoint:
            kwargs["endpoint_url"] = self.endpoint
        if not cfg.verify_tls:
            kwargs["verify"] = False
        if self._access_key and self._secret_key:
            kwargs.update(aws_access_key_id=self._access_key, aws_secret_access_key=self._secret_key)
            if self._session_token:
                kwargs["aws_session_token"] = self._session_token
        try:
            self._s3 = await self._stack.enter_async_context(session.create_client("s3", **kwargs))
            # "Expect: 100-continue" costs a round trip per PUT to save a body the server would refuse;
            # kvbm's bodies are a few MiB and refusals are rare, so send them straight away.
            from botocore.handlers import add_expect_header

            self._s3.meta.events.unregister("before-call.s3", add_expect_header)
            self._s3.meta.events.register("before-parse.s3.ListObjectsV2", _fast_list_contents)
            await self._connect(session)
        except TierUnavailableError as e:
            if not self.wait_for_endpoint:
                await self._teardown()
                raise
            # An outage, not misconfiguration: serve without G4 until the endpoint answers.
            self.last_error = str(e)
            self.breaker.trip(f"{self.endpoint_name} unreachable at start; G4 offline until it answers")
            self._prober = asyncio.get_running_loop().create_task(self._probe_until_online(session))
        except BaseException:
            await self._teardown()
            raise
        self._started = True
        if cfg.scan_on_start and self.online:
            async for _ in self.scan():
                pass

    async def _connect(self, session: Any) -> None:
        """Check (or create) the bucket and start NIXL; the tier is online afterwards."""
        await self._check_bucket()
        if self.client_kind == "nixl" and self._nixl is None:
            await self._start_nixl(session)
            self._body = _NixlBody(self)
        if self.client_kind == "http" and self._body is None:
            await self._start_http(session)
        self.online = True
        self.last_error = ""

    async def _probe_until_online(self, session: Any) -> None:
        """Re-check the endpoint with backoff (0.5 s doubling up to ``breaker_reset_s``) until it answers."""
        cap = max(1.0, self.cfg.breaker_reset_s)
        delay = min(0.5, cap)
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)
            try:
                await self._connect(session)
            except (TierUnavailableError, ConfigError) as e:
                # ConfigError now (e.g. a missing bucket that may not be created) is worth saying loudly,
                # but the tier keeps probing: an operator may fix it without restarting the daemon.
                if str(e) != self.last_error:
                    log.log(logging.ERROR if isinstance(e, ConfigError) else logging.INFO,
                            "S3 tier still offline: %s", e)
                self.last_error = str(e)
                self.breaker.failure()
                self.breaker.trip(self.last_error)
                continue
            except Exception as e:  # anything else: stay offline, keep probing
                self.last_error = f"{type(e).__name__}: {_one_line(e)}"
                self.breaker.failure()
                continue
            self.breaker.success()
            log.info("S3 endpoint %s answers: G4 online", self.endpoint_name)
            return

    async def _check_bucket(self) -> None:
        import botocore.exceptions as bex

        where = self.endpoint_name
        try:
            await self._s3.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
            return
        except bex.NoCredentialsError:
            raise ConfigError(
                f"no S3 credentials for {where}: set s3.access_key/s3.secret_key, AWS_* env or an AWS profile"
            ) from None
        except (bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ReadTimeoutError,
                bex.ConnectionClosedError) as e:
            raise TierUnavailableError(f"S3 endpoint {where} unreachable: {_one_line(e)}") from None
        except bex.ClientError as e:
            code = _err_code(e)
            if code in _CRED_CODES:
                raise ConfigError(f"S3 credentials rejected by {where} ({code})") from None
            if code in ("AccessDenied", "403", "Forbidden"):
                raise ConfigError(f"S3 access to bucket {self.bucket!r} denied by {where} ({code})") from None
            if code not in ("NoSuchBucket", "404"):
                raise TierUnavailableError(f"S3 endpoint {where}: {code}: {_one_line(e)}") from None
        except bex.BotoCoreError as e:
            raise TierUnavailableError(f"S3 endpoint {where}: {_one_line(e)}") from None
        # The bucket does not exist.
        if not self.cfg.create_bucket:
            raise ConfigError(f"S3 bucket {self.bucket!r} does not exist at {where} (s3.create_bucket is false)")
        try:
            kw: dict[str, Any] = {"Bucket": self.bucket}
            if self.endpoint is None and self.cfg.region != "us-east-1":
                kw["CreateBucketConfiguration"] = {"LocationConstraint": self.cfg.region}
            await self._s3.create_bucket(**kw)
        except bex.ClientError as e:
            if _err_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise ConfigError(
                    f"cannot create S3 bucket {self.bucket!r} at {where}: {_err_code(e)}: {_one_line(e)}"
                ) from None
        log.info("created S3 bucket %s at %s", self.bucket, where)

    async def _start_nixl(self, session: Any) -> None:
        ak, sk, tok = self._access_key, self._secret_key, self._session_token
        if not (ak and sk):
            creds = await session.get_credentials()
            if creds is None:
                raise ConfigError(f"no S3 credentials for the NIXL OBJ backend ({self.endpoint_name})")
            frozen = await creds.get_frozen_credentials()
            ak, sk, tok = frozen.access_key, frozen.secret_key, frozen.token
        self._nixl = _NixlObj(self.cfg, self.endpoint, self.bucket, ak, sk, tok)
        await self._nixl.start()
        # create_backend accepts any secret; prove the credentials with a real write + read.
        probe = f"{self._base()}.kvbm-probe/{uuid.uuid4().hex}"
        body = b"kvbm-nixl-probe"
        try:
            await self._nixl.write(probe, body)
            back = bytearray(len(body))
            await self._nixl.read(probe, memoryview(back))
            if bytes(back) != body:
                raise TierUnavailableError("NIXL OBJ probe read back different bytes")
        except TierUnavailableError as e:
            code = await self._diagnose()
            if code in _CRED_CODES:
                raise ConfigError(f"S3 credentials rejected by {self.endpoint_name} ({code}, NIXL OBJ)") from None
            raise TierUnavailableError(f"NIXL OBJ backend cannot use {self.endpoint_name}: {e}") from None
        finally:
            with contextlib.suppress(Exception):
                await self._s3.delete_object(Bucket=self.bucket, Key=probe)

    async def _start_http(self, session: Any) -> None:
        """The http body client, proven with a real write + read (its own signer, its own connections)."""
        from botocore.credentials import ReadOnlyCredentials

        if self._access_key and self._secret_key:
            fixed = ReadOnlyCredentials(self._access_key, self._secret_key, self._session_token)

            async def creds() -> Any:
                return fixed
        else:
            chain = await session.get_credentials()
            if chain is None:
                raise ConfigError(f"no S3 credentials for {self.endpoint_name}")

            async def creds() -> Any:
                return await chain.get_frozen_credentials()  # refreshed by botocore when near expiry

        try:
            client = HttpBodyClient(self.cfg, self.endpoint, self.bucket, creds)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        probe = f"{self._base()}.kvbm-probe/{uuid.uuid4().hex}"
        pkey = BlockKey("kvbm-probe-0000000000000000", uuid.uuid4().bytes)
        body = b"kvbm-http-probe"
        try:
            await client.put(probe, pkey, memoryview(body), {})
            back = bytearray(len(body))
            if await client.get_into(probe, pkey, memoryview(back)) != len(body) or bytes(back) != body:
                raise TierUnavailableError("probe read back different bytes")
        except Exception as e:
            client.close()
            code = _err_code(e)
            if code in _CRED_CODES:
                raise ConfigError(f"S3 credentials rejected by {self.endpoint_name} ({code}, http client)") from None
            raise TierUnavailableError(f"S3 http client cannot use {self.endpoint_name}: {_one_line(e)}") from None
        finally:
            with contextlib.suppress(Exception):
                await self._s3.delete_object(Bucket=self.bucket, Key=probe)
        self._body = client

    async def _diagnose(self) -> str:
        """Error code of a small signed request (tells bad credentials from other failures)."""
        try:
            await self._s3.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
            return ""
        except Exception as e:
            return _err_code(e)

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None
        await self._teardown()
        self._started = False
        self.online = False

    async def _teardown(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(Exception):
                await stack.aclose()
        self._s3 = None

    def _require_started(self) -> None:
        if not self._started or self._s3 is None:
            raise TierUnavailableError("S3 tier is not started (call await tier.start())")

    def _require_online(self) -> None:
        self._require_started()
        if not self.online:
            raise TierUnavailableError(f"S3 endpoint {self.endpoint_name} not reachable yet: {self.last_error}")

    def writable(self) -> bool:
        return (self.online and self._pending_writes < self.cfg.max_pending_writes
                and self.breaker.would_allow())

    # -- data path -------------------------------------------------------------------------------
    def _meta(self, key: BlockKey, nbytes: int) -> dict[str, str]:
        return {
            "kvbm-format": META_FORMAT,
            "kvbm-namespace": key.namespace,
            "kvbm-hash": key.hash.hex(),
            "kvbm-nbytes": str(nbytes),
            "kvbm-created": f"{time.time():.3f}",
        }

    def _shed(self, key: BlockKey, why: str) -> WriteShedError:
        self.stats.shed += 1
        return WriteShedError(f"G4 S3 {self.endpoint_name}: write of {key} shed ({why})")

    def _failed(self, what: str, key: BlockKey | None, e: BaseException) -> None:
        self.stats.errors += 1
        self.breaker.failure()
        now = time.monotonic()
        if now - self._warned_at > 5.0:
            self._warned_at = now
            log.warning("S3 %s %s failed at %s: %s", what, key or "", self.endpoint_name, _one_line(e))

    async def put(self, key: BlockKey, data: memoryview | bytes) -> None:
        self._require_started()
        n = memoryview(data).nbytes
        fp = self.footprint(n)
        old = self._index.get(key)
        if old is None and self.capacity_bytes and self._used + fp > self.capacity_bytes:
            raise TierFullError(f"G4 S3: {self._used + fp} bytes would exceed capacity {self.capacity_bytes}")
        if not self.online:
            raise self._shed(key, f"endpoint not reachable yet: {self.last_error}")
        if self._pending_writes >= self.cfg.max_pending_writes:
            raise self._shed(key, f"{self._pending_writes} writes in flight, s3.max_pending_writes")
        if not self.breaker.allow():
            raise self._shed(key, "circuit breaker open")
        self._pending_writes += 1
        try:
            okey = self.object_key(key)
            assert self._sem is not None
            async with self._sem:
                if self._body is not None:
                    t0 = time.perf_counter()
                    await self._body.put(okey, key, memoryview(data), self._meta(key, n))
                    self.observe("put", time.perf_counter() - t0)
                else:
                    buf = await self._encode(key, data)
                    try:
                        t0 = time.perf_counter()
                        await self._s3.put_object(Bucket=self.bucket, Key=okey, Body=buf, Metadata=self._meta(key, n))
                        self.observe("put", time.perf_counter() - t0)
                    finally:
                        self._release_body(buf)
        except (asyncio.CancelledError, KeyboardInterrupt):
            self.breaker._probing = False
            raise
        except Exception as e:
            self._failed("PUT", key, e)
            raise TierUnavailableError(f"S3 PUT of {key} at {self.endpoint_name} failed: {_one_line(e)}") from None
        finally:
            self._pending_writes -= 1
        self.breaker.success()
        self._index_set(key, n)
        self.stats.puts += 1
        self.stats.bytes_in += n

    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        self._require_started()
        self.stats.gets += 1
        if not self.online or not self.breaker.allow():
            self.stats.misses += 1
            return None
        okey = self.object_key(key)
        view = memoryview(out).cast("B")
        try:
            assert self._sem is not None
            async with self._sem:
                t0 = time.perf_counter()
                if self._body is None:
                    n = await self._stream_into(key, okey, view)
                else:
                    n = await self._body.get_into(okey, key, view)
                self.observe("get", time.perf_counter() - t0)
        except (asyncio.CancelledError, KeyboardInterrupt):
            self.breaker._probing = False
            raise
        except CorruptBlockError as e:
            self.breaker.success()
            log.warning("corrupt S3 object %s: %s (deleted)", okey, e)
            self.stats.corrupt += 1
            self.stats.misses += 1
            self._index_drop(key)
            with contextlib.suppress(Exception):
                await self._s3.delete_object(Bucket=self.bucket, Key=okey)
            return None
        except ValueError:
            raise
        except Exception as e:
            self._failed("GET", key, e)
            self.stats.misses += 1
            return None
        self.breaker.success()
        if n is None:
            self._index_drop(key)
            self.stats.misses += 1
            return None
        self._index_set(key, n)
        self.stats.hits += 1
        self.stats.bytes_out += n
        return n

    async def _encode(self, key: BlockKey, data: memoryview | bytes) -> bytearray:
        """``header || payload`` in a body buffer reused per size (botocore and NIXL take whole buffers, not
        views: no fresh, page-faulting 8 MiB allocation per block); checksum and copy off the event loop."""
        size = HEADER_LEN + memoryview(data).nbytes
        free = self._bodies.setdefault(size, [])
        buf = free.pop() if free else bytearray(size)
        if size >= _OFFLOOP_BYTES:
            await asyncio.to_thread(encode_block_into, buf, key, data, HEADER_LEN)
        else:
            encode_block_into(buf, key, data, HEADER_LEN)
        return buf

    def _release_body(self, buf: bytearray) -> None:
        free = self._bodies.setdefault(len(buf), [])
        if len(free) < self.cfg.max_concurrency:
            free.append(buf)

    @staticmethod
    def _copy_payload(key: BlockKey, body: bytes | bytearray, view: memoryview) -> int:
        payload = decode_block(key, body)
        n = payload.nbytes
        if n > view.nbytes:
            raise ValueError(f"{key}: block is {n} bytes, buffer has {view.nbytes}")
        view[:n] = payload
        return n

    async def _stream_into(self, key: BlockKey, okey: str, view: memoryview) -> int | None:
        """GET straight into ``view``: each received chunk is copied once, then the payload is verified.

        On a corrupt object ``view`` may hold garbage; the caller gets CorruptBlockError and must not
        use it (the manager aborts the slot).
        """
        try:
            resp = await self._s3.get_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            if _err_code(e) in _MISS_CODES:
                return None
            raise
        total = int(resp["ContentLength"])
        async with resp["Body"] as stream:
            head = bytearray(HEADER_LEN)
            await _read_exact(stream, memoryview(head), key)
            header = unpack_header(head)
            if header.header_len > HEADER_LEN:
                await _read_exact(stream, memoryview(bytearray(header.header_len - HEADER_LEN)), key)
            n = total - header.header_len
            if n != header.payload_len:
                raise CorruptBlockError(f"{key}: object holds {n} payload bytes, header says {header.payload_len}")
            if n > view.nbytes:
                raise ValueError(f"{key}: block is {n} bytes, buffer has {view.nbytes}")
            await _read_exact(stream, view[:n], key)
        if n >= _OFFLOOP_BYTES:
            await asyncio.to_thread(verify, key, header, view[:n])
        else:
            verify(key, header, view[:n])
        return n

    async def _fetch(self, key: BlockKey, okey: str) -> bytes | bytearray | None:
        """The object body through NIXL OBJ, or None if there is no such object."""
        assert self._nixl is not None
        n = self._index.get(key)
        if n is None:
            size = await self._head_size(okey)
            if size is None:
                return None
        else:
            size = n + HEADER_LEN
        buf = bytearray(size)
        try:
            await self._nixl.read(okey, memoryview(buf))
        except TierUnavailableError:
            # Gone (deleted by another node, or a different size now) or a real failure: ask HEAD.
            real = await self._head_size(okey)
            if real is None:
                return None
            if real != size:
                buf = bytearray(real)
                await self._nixl.read(okey, memoryview(buf))
            else:
                raise
        return buf

    async def _head_size(self, okey: str) -> int | None:
        self.stats.heads += 1
        try:
            resp = await self._s3.head_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            if _err_code(e) in _MISS_CODES:
                return None
            raise
        return int(resp["ContentLength"])

    async def delete(self, key: BlockKey) -> bool:
        self._require_online()
        okey = self.object_key(key)
        existed = key in self._index
        try:
            if not existed:
                existed = await self._head_size(okey) is not None
            await self._s3.delete_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            self.stats.errors += 1
            raise TierUnavailableError(f"S3 DELETE {okey} at {self.endpoint_name}: {_one_line(e)}") from None
        self._index_drop(key)
        if existed:
            self.stats.deletes += 1
        return existed

    # -- index -----------------------------------------------------------------------------------
    def _index_set(self, key: BlockKey, n: int) -> None:
        old = self._index.get(key)
        if old is not None:
            self._used -= self.footprint(old)
        self._index[key] = n
        self._used += self.footprint(n)

    def _index_drop(self, key: BlockKey) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= self.footprint(old)

    def nbytes(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    def footprint(self, nbytes: int) -> int:
        return nbytes + HEADER_LEN

    def used_bytes(self) -> int:
        return self._used

    async def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:  # type: ignore[override]
        """List every block under the prefix, or one namespace of it (paging), and rebuild the index."""
        self._require_online()
        before = {k for k in self._index if namespace is None or k.namespace == namespace}
        seen: set[BlockKey] = set()
        async for bkey, _okey, size, mtime in self.list_objects_parallel(namespace):
            if bkey is None or size < HEADER_LEN:
                continue
            seen.add(bkey)
            n = size - HEADER_LEN
            self._index_set(bkey, n)
            yield StoredBlock(key=bkey, nbytes=n, mtime=mtime.timestamp() if mtime else 0.0, footprint=size)
        for k in before - seen:
            self._index_drop(k)

    # -- batch operations (CLI: status, purge) ---------------------------------------------------
    async def list_objects(
        self, namespace: str | None = None, key_prefix: str | None = None
    ) -> AsyncIterator[tuple[BlockKey | None, str, int, _dt.datetime | None]]:
        """``(BlockKey or None for a foreign key, s3 key, size, last_modified)`` for every object under
        ``{prefix}/[{namespace}/][{key_prefix}]``; ``key_prefix`` is a raw key prefix relative to that
        (e.g. ``"llama-"`` for every namespace of a model slug, or ``"ab/"`` for one shard)."""
        self._require_online()
        list_prefix = self._base()
        if namespace:
            list_prefix += f"{namespace.strip('/')}/"
        if key_prefix:
            list_prefix += key_prefix.lstrip("/")
        async for page in self._list_pages(list_prefix):
            for entry in page:
                yield entry

    async def _list_pages(
        self, list_prefix: str, delimiter: str = "", dirs: list[str] | None = None, start_after: str = ""
    ) -> AsyncIterator[list[tuple[BlockKey | None, str, int, _dt.datetime | None]]]:
        """One list per LIST page under the raw key prefix ``list_prefix`` (keys after ``start_after``); with
        ``delimiter``, the common prefixes ("directories") are appended to ``dirs`` instead of being walked."""
        token: str | None = None
        parse = self.parse_key
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": list_prefix, "MaxKeys": LIST_PAGE}
            if delimiter:
                kw["Delimiter"] = delimiter
            if start_after and not token:
                kw["StartAfter"] = start_after
            if token:
                kw["ContinuationToken"] = token
            fast = _FAST_LIST.set(True)
            try:
                resp = await self._s3.list_objects_v2(**kw)
            except Exception as e:
                raise TierUnavailableError(f"S3 LIST {list_prefix!r} at {self.endpoint_name}: {_one_line(e)}") from None
            finally:
                _FAST_LIST.reset(fast)
            if dirs is not None:
                dirs.extend(cp["Prefix"] for cp in resp.get("CommonPrefixes", ()) or ())
            fast = resp.get("KvbmContents")
            if fast is not None:  # parsed by _fast_list_contents
                yield [(parse(k), k, size, _fast_timestamp(mt) if mt else None) for k, size, mt in fast]
            else:
                yield [(parse(o["Key"]), o["Key"], int(o.get("Size", 0)), o.get("LastModified"))
                       for o in resp.get("Contents", ()) or ()]
            if not resp.get("IsTruncated"):
                break
            token = resp.get("NextContinuationToken")
            if not token:
                break

    async def list_objects_parallel(
        self, namespace: str | None = None, concurrency: int | None = None
    ) -> AsyncIterator[tuple[BlockKey | None, str, int, _dt.datetime | None]]:
        """The same entries as :meth:`list_objects` (in another order), listed concurrently by key prefix.

        A LIST page holds at most 1,000 keys and a listing is sequential within one prefix, so a bucket of
        1M blocks is 1,000 round trips one after another. Here a delimiter LIST finds the namespaces under
        the prefix; each namespace is listed serially for its first ``LIST_SERIAL_PAGES`` pages (a small one
        is done then, in a few requests), and a larger one continues by shard directory
        (``{namespace}/{hh}/``, found with a delimiter LIST), every directory after the last key seen listed
        on its own, up to ``concurrency`` LISTs at a time (default ``s3.list_concurrency``). Directories that
        are not namespaces (foreign keys, access logs) are listed whole, so nothing is left out or repeated."""
        self._require_online()
        limit = max(1, concurrency or self.cfg.list_concurrency)
        base = self._base()
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=4 * limit)
        sem = asyncio.Semaphore(limit)
        done = object()

        async def walk(prefix: str, delimiter: str = "", dirs: list[str] | None = None, after: str = "",
                       max_pages: int = 0) -> str | None:
            """List ``prefix``; with ``max_pages``, stop after that many full pages and return the last key
            seen (None when the listing reached its end)."""
            pages = 0
            async with sem:
                async for page in self._list_pages(prefix, delimiter, dirs, after):
                    if page:
                        await queue.put(page)
                    pages += 1
                    if max_pages and pages >= max_pages and len(page) >= LIST_PAGE:
                        return page[-1][1]
            return None

        async def shards(ns_prefix: str) -> None:
            last = await walk(ns_prefix, max_pages=LIST_SERIAL_PAGES)
            if last is None:
                return
            dirs: list[str] = []
            tail: list[tuple[BlockKey | None, str, int, _dt.datetime | None]] = []
            async with sem:  # objects right under the namespace, and its shard directories
                async for page in self._list_pages(ns_prefix, "/", dirs):
                    tail += [e for e in page if e[1] > last]
            if tail:
                await queue.put(tail)
            jobs = []
            for d in dirs:
                if last.startswith(d):
                    jobs.append(walk(d, after=last))  # the directory the serial pages stopped in
                elif d > last:
                    jobs.append(walk(d))
            await asyncio.gather(*jobs)

        async def produce() -> None:
            try:
                if namespace:
                    await shards(f"{base}{namespace.strip('/')}/")
                else:
                    tops: list[str] = []
                    await walk(base, "/", tops)  # foreign objects right under the prefix, and its directories
                    jobs = []
                    for d in tops:
                        name = d[len(base) :].rstrip("/")
                        sharded = self.shard_chars and is_namespace(name)
                        jobs.append(shards(d) if sharded else walk(d))
                    await asyncio.gather(*jobs)
                await queue.put(done)
            except BaseException as e:  # handed to the consumer, which raises it
                await queue.put(e)

        task = asyncio.get_running_loop().create_task(produce())
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                for entry in item:
                    yield entry
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # -- small auxiliary objects (access logs) ------------------------------------------------------
    async def put_aux(self, okey: str, body: bytes) -> None:
        """PUT a small non-block object (e.g. an access log) under the prefix; raises TierUnavailableError."""
        self._require_online()
        if self.parse_key(okey) is not None or not okey.startswith(self._base()):
            raise ValueError(f"{okey!r} is not an auxiliary key under the prefix")
        assert self._sem is not None
        async with self._sem:
            try:
                await self._s3.put_object(Bucket=self.bucket, Key=okey, Body=body)
            except Exception as e:
                raise TierUnavailableError(f"S3 PUT {okey} at {self.endpoint_name}: {_one_line(e)}") from None

    async def get_aux(self, okey: str) -> bytes | None:
        """GET a small non-block object; None when it does not exist."""
        self._require_online()
        assert self._sem is not None
        async with self._sem:
            try:
                resp = await self._s3.get_object(Bucket=self.bucket, Key=okey)
                async with resp["Body"] as stream:
                    return bytes(await stream.read())
            except Exception as e:
                if _err_code(e) in _MISS_CODES:
                    return None
                raise TierUnavailableError(f"S3 GET {okey} at {self.endpoint_name}: {_one_line(e)}") from None

    async def head_many(self, keys: Iterable[BlockKey]) -> dict[BlockKey, dict[str, Any] | None]:
        """HEAD each block (``max_concurrency`` at a time): ``{key: {size, nbytes, last_modified, metadata}}``
        or None where there is no object. Updates the index."""
        self._require_online()
        assert self._sem is not None
        sem = self._sem

        async def one(k: BlockKey) -> tuple[BlockKey, dict[str, Any] | None]:
            okey = self.object_key(k)
            async with sem:
                self.stats.heads += 1
                try:
                    r = await self._s3.head_object(Bucket=self.bucket, Key=okey)
                except Exception as e:
                    if _err_code(e) in _MISS_CODES:
                        return k, None
                    raise TierUnavailableError(f"S3 HEAD {okey} at {self.endpoint_name}: {_one_line(e)}") from None
            size = int(r["ContentLength"])
            meta = r.get("Metadata") or {}
            nb = int(meta["kvbm-nbytes"]) if str(meta.get("kvbm-nbytes", "")).isdigit() else size - HEADER_LEN
            return k, {"s3_key": okey, "size": size, "nbytes": nb, "last_modified": r.get("LastModified"),
                       "metadata": meta}

        out = dict(await asyncio.gather(*(one(k) for k in dict.fromkeys(keys))))
        for k, v in out.items():
            if v is None:
                self._index_drop(k)
            elif v["size"] >= HEADER_LEN:
                self._index_set(k, v["nbytes"])
        return out

    async def exists_many(self, keys: Iterable[BlockKey], concurrency: int | None = None) -> dict[BlockKey, int | None]:
        """Existence probe (HEAD, at most ``concurrency`` in flight, default ``max_concurrency``): payload bytes of
        each block the bucket holds, None for each it lacks (404). Keys whose HEAD failed otherwise are left out
        (unknown, not missing). Updates the index. Raises TierUnavailableError when the endpoint is offline or the
        circuit breaker is open (nothing was asked)."""
        self._require_online()
        todo = list(dict.fromkeys(keys))
        if not todo:
            return {}
        if not self.breaker.allow():
            raise TierUnavailableError(f"S3 {self.endpoint_name}: circuit breaker open")
        sem = asyncio.Semaphore(max(1, concurrency or self.cfg.max_concurrency))
        assert self._sem is not None
        shared = self._sem

        async def one(k: BlockKey) -> tuple[BlockKey, int | BaseException | None]:
            okey = self.object_key(k)
            async with sem, shared:
                self.stats.heads += 1
                t0 = time.perf_counter()
                try:
                    r = await self._s3.head_object(Bucket=self.bucket, Key=okey)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if _err_code(e) in _MISS_CODES:
                        return k, None
                    return k, e
                self.observe("head", time.perf_counter() - t0)
            size = int(r["ContentLength"])
            if size < HEADER_LEN:
                return k, None  # not a block (foreign or truncated): never indexed
            meta = r.get("Metadata") or {}
            nb = str(meta.get("kvbm-nbytes", ""))
            return k, int(nb) if nb.isdigit() and int(nb) == size - HEADER_LEN else size - HEADER_LEN

        out: dict[BlockKey, int | None] = {}
        failed: BaseException | None = None
        try:
            got = await asyncio.gather(*(one(k) for k in todo))
        except BaseException:
            self.breaker._probing = False
            raise
        for k, v in got:
            if isinstance(v, BaseException):
                failed = v
                continue
            out[k] = v
            if v is None:
                self._index_drop(k)
            else:
                self._index_set(k, v)
        if failed is not None:
            self._failed("HEAD", None, failed)
        elif out:
            self.breaker.success()
        return out

    def remember(self, key: BlockKey, nbytes: int) -> None:
        """Index a block another node wrote (learned from its event or a probe), without I/O."""
        self._index_set(key, nbytes)

    def forget(self, key: BlockKey) -> None:
        """Drop a block another node deleted from the index, without I/O."""
        self._index_drop(key)

    async def delete_many(self, s3_keys: Iterable[str]) -> tuple[int, list[tuple[str, str, str]]]:
        """DeleteObjects in chunks of 1000: ``(deleted, [(key, code, message), ...])``."""
        self._require_online()
        keys = list(dict.fromkeys(s3_keys))
        deleted = 0
        errors: list[tuple[str, str, str]] = []
        for i in range(0, len(keys), DELETE_CHUNK):
            chunk = keys[i : i + DELETE_CHUNK]
            try:
                resp = await self._s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
                )
            except Exception as e:
                errors.extend((k, _err_code(e) or type(e).__name__, _one_line(e)) for k in chunk)
                continue
            failed = {err["Key"]: err for err in resp.get("Errors", ()) or ()}
            for k in chunk:
                if k in failed:
                    errors.append((k, str(failed[k].get("Code", "")), str(failed[k].get("Message", ""))))
                    continue
                deleted += 1
                bk = self.parse_key(k)
                if bk is not None:
                    self._index_drop(bk)
        self.stats.deletes += deleted
        return deleted, errors

    async def usage(self) -> dict[str, dict[str, Any]]:
        """Per namespace: ``{objects, bytes, oldest, newest}`` (bytes are object sizes; times are datetimes)."""
        out: dict[str, dict[str, Any]] = {}
        async for bkey, _k, size, mtime in self.list_objects_parallel():
            if bkey is None:
                continue
            u = out.setdefault(bkey.namespace, {"objects": 0, "bytes": 0, "oldest": None, "newest": None})
            u["objects"] += 1
            u["bytes"] += size
            if mtime is not None:
                if u["oldest"] is None or mtime < u["oldest"]:
                    u["oldest"] = mtime
                if u["newest"] is None or mtime > u["newest"]:
                    u["newest"] = mtime
        return out

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.update(
            endpoint=self.endpoint_name, bucket=self.bucket, prefix=self.prefix, client=self.client_kind,
            breaker=self.breaker.describe(), online=self.online, last_error=self.last_error,
            pending_writes=self._pending_writes, indexed_blocks=len(self._index),
        )
        return d

    @classmethod
    def from_config(
        cls, cfg: S3Config, endpoint: str | None = None, credentials: tuple[str, ...] | None = None, **kw: Any
    ) -> S3Tier:
        return make_s3_tier(cfg, endpoint, credentials, **kw)


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


class _NixlBody:
    """:class:`BodyBackend` over NIXL OBJ: bodies are staged in a buffer (NIXL registers whole regions)."""

    def __init__(self, tier: S3Tier) -> None:
        self.tier = tier

    async def put(self, okey: str, key: BlockKey, payload: memoryview, meta: dict[str, str]) -> None:
        t = self.tier
        assert t._nixl is not None
        buf = await t._encode(key, payload)
        try:
            await t._nixl.write(okey, buf)
        finally:
            t._release_body(buf)

    async def get_into(self, okey: str, key: BlockKey, view: memoryview) -> int | None:
        body = await self.tier._fetch(key, okey)
        return None if body is None else self.tier._copy_payload(key, body, view)

    def close(self) -> None:
        pass  # the tier closes its _NixlObj


class _NixlObj:
    """The NIXL OBJ backend, driven from a private thread pool (its calls block)."""

    _agent_ids = itertools.count()

    def __init__(self, cfg: S3Config, endpoint: str | None, bucket: str, ak: str, sk: str, tok: str | None):
        self.cfg = cfg
        self.endpoint = endpoint
        self.bucket = bucket
        self._ak, self._sk, self._tok = ak, sk, tok
        self._agent: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._dev_ids = itertools.count(1)

    def _params(self) -> dict[str, str]:
        p = {
            "bucket": self.bucket,
            "create_bucket": "false",
            "region": self.cfg.region,
            "access_key": self._ak,
            "secret_key": self._sk,
            "use_virtual_addressing": "true" if self.cfg.addressing == "virtual" else "false",
            "req_checksum": "supported",
            "num_threads": str(max(2, self.cfg.max_concurrency)),
        }
        if self._tok:
            p["session_token"] = self._tok
        if self.endpoint:
            scheme, _, host = self.endpoint.partition("://")
            p["scheme"] = scheme or "http"
            p["endpoint_override"] = host.rstrip("/")
        return p

    async def start(self) -> None:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise ConfigError(f"s3.client is 'nixl' but NIXL cannot be imported: {e}") from None

        def make() -> Any:
            conf = nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            agent = nixl_agent(f"kvbm-s3-{os.getpid()}-{next(self._agent_ids)}", conf)
            agent.create_backend("OBJ", self._params())
            return agent

        self._pool = ThreadPoolExecutor(max_workers=max(1, self.cfg.max_concurrency), thread_name_prefix="kvbm-nixl")
        try:
            self._agent = await asyncio.get_running_loop().run_in_executor(self._pool, make)
        except Exception as e:
            self.close()
            # Never echo the parameters: they hold the secret.
            raise TierUnavailableError(f"NIXL OBJ backend did not start: {type(e).__name__}") from None

    def close(self) -> None:
        if self._pool is not None:
            # Do not wait for a transfer stuck in aws-sdk-cpp's retries (~25 s on a dead endpoint); the
            # thread keeps its own references to the agent and buffer and ends by itself.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._agent = None

    def _xfer(self, op: str, okey: str, buf: memoryview) -> None:
        import numpy as np

        agent = self._agent
        arr = np.frombuffer(buf, dtype=np.uint8)
        addr, n = int(arr.ctypes.data), int(arr.size)
        dev = next(self._dev_ids) % (1 << 30)
        local = agent.register_memory([(addr, n, 0, "")], "DRAM")
        try:
            remote = agent.register_memory([(0, n, dev, okey)], "OBJ")
            try:
                handle = agent.initialize_xfer(
                    op, agent.get_xfer_descs([(addr, n, 0)], "DRAM"), agent.get_xfer_descs([(0, n, dev)], "OBJ"),
                    agent.name,
                )
                try:
                    state = agent.transfer(handle)
                    delay = 0.0002
                    while state == "PROC":
                        time.sleep(delay)
                        delay = min(delay * 2, 0.005)
                        state = agent.check_xfer_state(handle)
                    if state != "DONE":
                        raise RuntimeError(f"transfer state {state}")
                finally:
                    agent.release_xfer_handle(handle)
            finally:
                agent.deregister_memory(remote)
        finally:
            agent.deregister_memory(local)

    async def _run(self, op: str, okey: str, buf: memoryview) -> None:
        if self._agent is None or self._pool is None:
            raise TierUnavailableError("NIXL OBJ backend is closed")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._xfer, op, okey, buf)
        try:
            # On timeout the worker thread finishes on its own; it holds its own reference to ``buf``.
            await asyncio.wait_for(fut, self.cfg.nixl_timeout_s)
        except asyncio.TimeoutError:
            raise TierUnavailableError(f"NIXL OBJ {op} {okey}: no answer in {self.cfg.nixl_timeout_s:g}s") from None
        except Exception as e:
            raise TierUnavailableError(f"NIXL OBJ {op} {okey}: {type(e).__name__}: {_one_line(e)}") from None

    async def write(self, okey: str, body: bytes | bytearray) -> None:
        # NIXL registers memory by address; bytes are immutable but readable, which is all WRITE needs.
        await self._run("WRITE", okey, memoryview(body))

    async def read(self, okey: str, out: memoryview) -> None:
        await self._run("READ", okey, out)
