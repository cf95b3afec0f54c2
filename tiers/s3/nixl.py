"""The ``nixl`` body backend: block bodies through the NIXL OBJ backend (aws-sdk-cpp), whose blocking calls
run in a private thread pool."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvbm.blocks import MIN_HEADER_LEN, BlockKey
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.tiers.s3.bodies import OFFLOOP_BYTES, BodyBuffers, copy_payload
from kvbm.tiers.s3.codes import one_line, probe_failure
from kvbm.transfer.nixl_agent import nixl_api

if TYPE_CHECKING:
    from kvbm.tiers.s3.session import S3Session
    from kvbm.tiers.s3.tier import S3Tier


async def start_nixl(tier: S3Session, session: Any) -> NixlObj:
    """The NIXL OBJ backend for ``tier``, started and its credentials proven with a real write + read."""
    frozen = await (await tier.credential_source(session, f"the NIXL OBJ backend ({tier.endpoint_name})"))()
    obj = NixlObj(tier.cfg, tier.endpoint, tier.bucket, frozen.access_key, frozen.secret_key, frozen.token)
    await obj.start()
    # create_backend accepts any secret; prove the credentials with a real write + read.
    probe = f"{tier._base()}.kvbm-probe/{uuid.uuid4().hex}"
    body = b"kvbm-nixl-probe"
    try:
        await obj.write(probe, body)
        back = bytearray(len(body))
        await obj.read(probe, memoryview(back))
        if bytes(back) != body:
            raise TierUnavailableError("NIXL OBJ probe read back different bytes")
    except TierUnavailableError as e:
        obj.close()
        raise probe_failure(tier.endpoint_name, "NIXL OBJ backend", await tier._diagnose(), e) from None
    except BaseException:
        obj.close()
        raise
    finally:
        with contextlib.suppress(Exception):
            await tier._s3.delete_object(Bucket=tier.bucket, Key=probe)
    return obj


class NixlBody:
    """:class:`BodyBackend` over NIXL OBJ: bodies are staged in a buffer (NIXL registers whole regions)."""

    def __init__(self, tier: S3Tier, obj: NixlObj) -> None:
        self.tier = tier  # for its index (object sizes) and HEAD
        self.obj = obj
        self._buffers = BodyBuffers(tier.cfg.max_concurrency)

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
        t = self.tier
        n = t.nbytes(key)
        if n is None:
            size = await t._head_size(okey)
            if size is None:
                return None
        else:
            size = n + MIN_HEADER_LEN
        buf = bytearray(size)
        try:
            await self.obj.read(okey, memoryview(buf))
        except TierUnavailableError:
            # Gone (deleted by another node, or a different size now) or a real failure: ask HEAD.
            real = await t._head_size(okey)
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
            api = nixl_api()
        except ImportError as e:
            raise ConfigError(f"s3.client is 'nixl' but NIXL cannot be imported: {e}") from None

        def make() -> Any:
            conf = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            agent = api.nixl_agent(f"kvbm-s3-{os.getpid()}-{next(self._agent_ids)}", conf)
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
            raise TierUnavailableError(f"NIXL OBJ {op} {okey}: {type(e).__name__}: {one_line(e)}") from None

    async def write(self, okey: str, body: bytes | bytearray) -> None:
        # NIXL registers memory by address; bytes are immutable but readable, which is all WRITE needs.
        await self._run("WRITE", okey, memoryview(body))

    async def read(self, okey: str, out: memoryview) -> None:
        await self._run("READ", okey, out)
