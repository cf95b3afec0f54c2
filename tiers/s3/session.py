"""The S3 tier's connection: the aiobotocore client (unsigned-payload signer, fast LIST parsing), credentials, the
body backend (http, aiobotocore or NIXL), naming, health (breaker, failures) and the offline -> online logic
(``wait_for_endpoint``). :class:`S3Session` is what the tier's parts (:mod:`.tier`, :mod:`.listing`, :mod:`.bulk`)
share; each reaches it through its public methods."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvbm.blocks import MIN_HEADER_LEN, BlockKey
from kvbm.blocks.keys import object_relkey, parse_object_relkey
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.tiers.base import TierStats, no_observe
from kvbm.tiers.s3.aio import AioBody
from kvbm.tiers.s3.bodies import BodyBackend
from kvbm.tiers.s3.breaker import CircuitBreaker
from kvbm.tiers.s3.codes import MISS_CODES, error_code, one_line
from kvbm.tiers.s3.connect import check_bucket, start_http, start_nixl
from kvbm.tiers.s3.fastlist import fast_list_contents, fast_timestamp
from kvbm.tiers.s3.index import ObjectIndex
from kvbm.tiers.s3.nixl import NixlBody, NixlObj
from kvbm.tiers.s3.signer import UNSIGNED_SIGV4, register_unsigned_signer

log = logging.getLogger("kvbm.tiers.s3")

HEADER_LEN = MIN_HEADER_LEN

class S3Stats(TierStats):
    """The tier's counters plus HEAD requests (existence probes, listing tools)."""

    heads: int = 0
    delete_requests: int = 0  # DELETE and DeleteObjects requests (one per 1,000 keys)
    reconfirms: int = 0  # blocks HEADed again before a durability decision relied on them (kvbm.manager.knowledge)
    stale: int = 0  # of them, blocks the bucket no longer held (deleted by another node): forgotten


class S3Credentials:
    """The tier's credentials: keys given (the arguments, else the config), else botocore's chain. Never logged."""

    def __init__(self, cfg: S3Config, access_key: str | None, secret_key: str | None, token: str | None) -> None:
        self._access_key = access_key if access_key is not None else (cfg.access_key or None)
        self._secret_key = secret_key if secret_key is not None else (cfg.secret_key or None)
        self._session_token = token if token is not None else (cfg.session_token or None)

    def client_kwargs(self) -> dict[str, str]:
        """The aiobotocore client's keyword arguments for the given keys ({}: the client resolves the chain)."""
        if not (self._access_key and self._secret_key):
            return {}
        out = {"aws_access_key_id": self._access_key, "aws_secret_access_key": self._secret_key}
        if self._session_token:
            out["aws_session_token"] = self._session_token
        return out

    async def source(self, session: Any, what: str) -> Callable[[], Awaitable[Any]]:
        """An async callable giving the current credentials (``access_key``, ``secret_key``, ``token``): the
        configured keys, else the session's chain, refreshed by botocore when near expiry; ``what`` names the
        client in the error when there are none."""
        from botocore.credentials import ReadOnlyCredentials

        if self._access_key and self._secret_key:
            fixed = ReadOnlyCredentials(self._access_key, self._secret_key, self._session_token)

            async def configured() -> Any:
                return fixed
            return configured
        chain = await session.get_credentials()
        if chain is None:
            raise ConfigError(f"no S3 credentials for {what}")

        async def refreshed() -> Any:
            return await chain.get_frozen_credentials()
        return refreshed


class S3Session:
    """One bucket under one prefix at one endpoint: the client, the body backend, naming and health. The tier
    (:class:`~kvbm.tiers.s3.tier.S3Tier`) builds it and hands it the block index and counters it keeps."""

    def __init__(
        self,
        cfg: S3Config,
        *,
        objects: ObjectIndex,
        stats: S3Stats,
        endpoint: str | None = None,
        credentials: tuple[str | None, str | None, str | None] = (None, None, None),
        bucket: str | None = None,
        prefix: str | None = None,
        client: str | None = None,
        wait_for_endpoint: bool = False,
    ) -> None:
        self.cfg = cfg
        self.objects = objects  # sizes and sightings of the bucket's blocks (the tier's index)
        self.stats = stats  # the tier's counters
        self.endpoint = endpoint if endpoint is not None else (cfg.endpoint or None)
        self.bucket = bucket if bucket is not None else cfg.bucket
        self.prefix = (prefix if prefix is not None else cfg.prefix).strip("/")
        self.client_kind = client or cfg.client
        if self.client_kind not in ("aiobotocore", "http", "nixl"):
            raise ConfigError(f"s3.client: {self.client_kind!r} is not 'aiobotocore', 'http' or 'nixl'")
        if len(self.bucket) < 3:
            raise ConfigError(f"s3.bucket: {self.bucket!r} is shorter than 3 characters")
        self.shard_chars = cfg.shard_chars
        self.credentials = S3Credentials(cfg, *credentials)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self.observe = no_observe  # (op, seconds) per successful request; see kvbm.daemon.metrics
        self._sem: asyncio.Semaphore | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: Any = None
        self._nixl: NixlObj | None = None
        self._body: BodyBackend | None = None  # block bodies (http, aiobotocore, nixl); set once online
        self._started = False
        self._warned_at = 0.0
        # Offline: started, but the endpoint has not answered yet (only with wait_for_endpoint).
        self.wait_for_endpoint = wait_for_endpoint
        self.online = False
        self.last_error = ""
        self._prober: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._started

    @property
    def client(self) -> Any:
        """The aiobotocore S3 client (control calls: HEAD, LIST, DELETE, bucket checks); None until started."""
        return self._s3

    @property
    def body(self) -> BodyBackend:
        """The block body backend; call :meth:`require_online` first."""
        assert self._body is not None
        return self._body

    @property
    def sem(self) -> asyncio.Semaphore:
        """At most ``max_concurrency`` requests at a time, shared by every part of the tier."""
        assert self._sem is not None
        return self._sem

    # -- naming ----------------------------------------------------------------------------------
    @property
    def endpoint_name(self) -> str:
        return self.endpoint or "AWS S3"

    @property
    def base(self) -> str:
        """The key prefix every object of this tier starts with ("" or ``{prefix}/``)."""
        return f"{self.prefix}/" if self.prefix else ""

    def object_key(self, key: BlockKey) -> str:
        return f"{self.base}{object_relkey(key, self.shard_chars)}"

    def parse_key(self, s3_key: str) -> BlockKey | None:
        """The BlockKey an object key names, or None for a key this scheme did not write."""
        base = self.base
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
        session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=fast_timestamp)
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
            register_unsigned_signer()
            aio_cfg = aio_cfg.merge(AioConfig(signature_version=UNSIGNED_SIGV4))
        kwargs: dict[str, Any] = {"region_name": cfg.region, "config": aio_cfg}
        if self.endpoint:
            kwargs["endpoint_url"] = self.endpoint
        if not cfg.verify_tls:
            kwargs["verify"] = False
        kwargs.update(self.credentials.client_kwargs())
        try:
            self._s3 = await self._stack.enter_async_context(session.create_client("s3", **kwargs))
            # "Expect: 100-continue" costs a round trip per PUT to save a body the server would refuse;
            # kvbm's bodies are a few MiB and refusals are rare, so send them straight away.
            from botocore.handlers import add_expect_header

            self._s3.meta.events.unregister("before-call.s3", add_expect_header)
            self._s3.meta.events.register("before-parse.s3.ListObjectsV2", fast_list_contents)
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

    async def _connect(self, session: Any) -> None:
        """Check (or create) the bucket and start the body backend; the tier is online afterwards."""
        await check_bucket(self)
        if self.client_kind == "nixl" and self._nixl is None:
            self._nixl = await start_nixl(self, session)
            self._body = NixlBody(self._nixl, self.objects.sizes.get, self.head_size)
        if self.client_kind == "http" and self._body is None:
            self._body = await start_http(self, session)
        if self.client_kind == "aiobotocore" and self._body is None:
            self._body = AioBody(self._s3, self.bucket, self.cfg.max_concurrency)
        self.online = True
        self.last_error = ""

    async def credential_source(self, session: Any, what: str) -> Callable[[], Awaitable[Any]]:
        """See :meth:`S3Credentials.source`."""
        return await self.credentials.source(session, what)

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
                self.last_error = f"{type(e).__name__}: {one_line(e)}"
                self.breaker.failure()
                continue
            self.breaker.success()
            log.info("S3 endpoint %s answers: G4 online", self.endpoint_name)
            return

    async def diagnose(self) -> str:
        """Error code of a small signed request (tells bad credentials from other failures)."""
        try:
            await self._s3.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
            return ""
        except Exception as e:
            return error_code(e)

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

    def require_started(self) -> None:
        if not self._started or self._s3 is None:
            raise TierUnavailableError("S3 tier is not started (call await tier.start())")

    def require_online(self) -> None:
        self.require_started()
        if not self.online:
            raise TierUnavailableError(f"S3 endpoint {self.endpoint_name} not reachable yet: {self.last_error}")

    def failed(self, what: str, key: BlockKey | None, e: BaseException) -> None:
        """A request failed: counted, told to the breaker, and logged (at most one line every 5 s)."""
        self.stats.errors += 1
        self.breaker.failure()
        now = time.monotonic()
        if now - self._warned_at > 5.0:
            self._warned_at = now
            log.warning("S3 %s %s failed at %s: %s", what, key or "", self.endpoint_name, one_line(e))

    async def head_size(self, okey: str) -> int | None:
        """An object's size by HEAD (counted in ``stats.heads``); None when there is no such object."""
        self.stats.heads += 1
        try:
            resp = await self._s3.head_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            if error_code(e) in MISS_CODES:
                return None
            raise
        return int(resp["ContentLength"])
