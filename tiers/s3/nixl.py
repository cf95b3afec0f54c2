"""The ``nixl`` body backend: block bodies through the NIXL OBJ backend (aws-sdk-cpp), whose blocking calls
run in a private thread pool."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbm.blocks import MIN_HEADER_LEN, BlockKey
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.tiers.s3.bodies import OFFLOOP_BYTES, BodyBuffers, copy_payload
from kvbm.tiers.s3.codes import one_line
from kvbm.transfer.nixl_agent import nixl_api


class NixlBody:
    """:class:`BodyBackend` over NIXL OBJ: bodies are staged in a buffer (NIXL registers whole regions)."""

    def __init__(self, obj: NixlObj, nbytes: Callable[[BlockKey], int | None],
                 head_size: Callable[[str], Awaitable[int | None]]) -> None:
        self.obj = obj
        self._nbytes = nbytes  # the index's payload size of a block (None: not indexed)
        self._head_size = head_size  # an object's size by HEAD (None: no such object)
        self._buffers = BodyBuffers(obj.cfg.max_concurrency)

    async def put(self, okey: str, key: BlockKey, payload: memoryview, meta: dict[str, str]) -> None:
        buf = await self._buffers.encode(key, payload)
        try:
            await self.obj.write(okey, buf)
        finally:
            self._buffers.release(buf)

    async def get_into(self, okey: str, key: BlockKey, view: memoryview) -> int | None:
        body = await self._fetch(key, okey)
        if body is None:
            return None
        if len(body) < OFFLOOP_BYTES:
            return copy_payload(key, body, view)
        # Verify and copy in a thread (an 8 MiB xxh3 and copy would stall the event loop); a cancelled caller
        # still waits for it, so nothing writes into ``view`` after this returns.
        fut = asyncio.ensure_future(asyncio.to_thread(copy_payload, key, body, view))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await fut
            raise

    async def _fetch(self, key: BlockKey, okey: str) -> bytes | bytearray | None:
        """The object body, or None if there is no such object (NIXL reads need the size up front)."""
        n = self._nbytes(key)
        if n is None:
            size = await self._head_size(okey)
            if size is None:
                return None
        else:
            size = n + MIN_HEADER_LEN
        buf = bytearray(size)
        try:
            await self.obj.read(okey, memoryview(buf))
        except TierUnavailableError:
            # Gone (deleted by another node, or a different size now) or a real failure: ask HEAD.
            real = await self._head_size(okey)
            if real is None:
                return None
            if real != size:
                buf = bytearray(real)
                await self.obj.read(okey, memoryview(buf))
            else:
                raise
        return buf

    def close(self) -> None:
        pass  # the tier closes its NixlObj


class NixlObj:
    """The NIXL OBJ backend, driven from a private thread pool (its calls block)."""

    _agent_ids = itertools.count()

    def __init__(self, cfg: S3Config, endpoint: str | None, bucket: str,
                 credentials: Callable[[], Awaitable[Any]]) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.bucket = bucket
        # The credential source (access_key, secret_key, token), asked before each transfer as the http client
        # does: botocore refreshes expiring ones, and an agent is made anew when they changed (aws-sdk-cpp holds
        # the ones its backend was created with).
        self._credentials = credentials
        self._creds: tuple[str, str, str | None] = ("", "", None)
        self._agent: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._dev_ids = itertools.count(1)
        self._renewing = asyncio.Lock()

    def _params(self, creds: tuple[str, str, str | None]) -> dict[str, str]:
        ak, sk, tok = creds
        p = {
            "bucket": self.bucket,
            "create_bucket": "false",
            "region": self.cfg.region,
            "access_key": ak,
            "secret_key": sk,
            "use_virtual_addressing": "true" if self.cfg.addressing == "virtual" else "false",
            "req_checksum": "supported",
            "num_threads": str(max(2, self.cfg.max_concurrency)),
        }
        if tok:
            p["session_token"] = tok
        if self.endpoint:
            scheme, _, host = self.endpoint.partition("://")
            p["scheme"] = scheme or "http"
            p["endpoint_override"] = host.rstrip("/")
        return p

    async def _current(self) -> tuple[str, str, str | None]:
        c = await self._credentials()
        return c.access_key, c.secret_key, c.token

    async def _make_agent(self, creds: tuple[str, str, str | None]) -> Any:
        """A new agent with an OBJ backend for ``creds`` (in the pool: creating one blocks)."""
        try:
            api = nixl_api()
        except ImportError as e:
            raise ConfigError(f"s3.client is 'nixl' but NIXL cannot be imported: {e}") from None

        def make() -> Any:
            conf = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            agent = api.nixl_agent(f"kvbm-s3-{os.getpid()}-{next(self._agent_ids)}", conf)
            agent.create_backend("OBJ", self._params(creds))
            return agent

        assert self._pool is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, make)
        except Exception as e:
            # Never echo the parameters: they hold the secret.
            raise TierUnavailableError(f"NIXL OBJ backend did not start: {type(e).__name__}") from None

    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.cfg.max_concurrency), thread_name_prefix="kvbm-nixl")
        try:
            creds = await self._current()
            self._agent = await self._make_agent(creds)
            self._creds = creds
        except BaseException:
            self.close()
            raise

    async def _agent_for_now(self) -> Any:
        """The agent for the source's current credentials: the same one until they change (rotated, or refreshed
        by botocore before they expire); then a new one, which transfers already running do not use."""
        creds = await self._current()
        if creds != self._creds:
            async with self._renewing:
                if creds != self._creds:
                    self._agent = await self._make_agent(creds)
                    self._creds = creds
        return self._agent

    def close(self) -> None:
        if self._pool is not None:
            # Do not wait for a transfer stuck in aws-sdk-cpp's retries (~25 s on a dead endpoint); the
            # thread keeps its own references to the agent and buffer and ends by itself.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._agent = None

    def _xfer(self, agent: Any, op: str, okey: str, buf: memoryview) -> None:
        import numpy as np

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
        try:
            agent = await self._agent_for_now()
        except TierUnavailableError:
            raise
        except Exception as e:  # the credential source failed (e.g. its process): this transfer fails
            raise TierUnavailableError(
                f"NIXL OBJ {op} {okey}: credentials: {type(e).__name__}: {one_line(e)}") from None
        if self._pool is None:
            raise TierUnavailableError("NIXL OBJ backend is closed")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._xfer, agent, op, okey, buf)
        try:
            # On timeout the worker thread finishes on its own; it holds its own reference to ``buf``.
            await asyncio.wait_for(fut, self.cfg.nixl_timeout_s)
        except asyncio.TimeoutError:
            raise TierUnavailableError(f"NIXL OBJ {op} {okey}: no answer in {self.cfg.nixl_timeout_s:g}s") from None
        except Exception as e:
            raise TierUnavailableError(f"NIXL OBJ {op} {okey}: {type(e).__name__}: {one_line(e)}") from None

    async def write(self, okey: str, body: bytes | bytearray) -> None:
        # NIXL registers memory by address; bytes are immutable but readable, which is all WRITE needs.
        await self._run("WRITE", okey, memoryview(body))

    async def read(self, okey: str, out: memoryview) -> None:
        await self._run("READ", okey, out)
