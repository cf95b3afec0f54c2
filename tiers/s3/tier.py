"""G4: S3-compatible object storage (AWS S3, SeaweedFS, MinIO, ...): :class:`S3Tier` and its data path.

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

``http`` and ``nixl`` are :class:`~kvbm.tiers.s3.bodies.BodyBackend` implementations (``self._body``); control
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
import logging
import time
from typing import Any

from kvbm.blocks import (
    FORMAT_VERSION,
    BlockKey,
    decode_block,
    encode_block_into,
    unpack_header,
    verify,
)
from kvbm.config import S3Config
from kvbm.errors import CorruptBlockError, TierFullError, TierUnavailableError, WriteShedError
from kvbm.tiers.s3.bulk import S3Bulk
from kvbm.tiers.s3.codes import _MISS_CODES, _err_code, _one_line
from kvbm.tiers.s3.session import HEADER_LEN

log = logging.getLogger("kvbm.tiers.s3")

META_FORMAT = f"kvbm-block-v{FORMAT_VERSION}"
# Checksums of bodies this large run in a thread, not on the event loop.
_OFFLOOP_BYTES = 256 * 1024


async def _read_exact(stream: Any, dst: memoryview, key: BlockKey) -> None:
    """Fill ``dst`` from a response body, copying each received chunk once."""
    pos, n = 0, dst.nbytes
    while pos < n:
        chunk = await stream.read(n - pos)
        if not chunk:
            raise CorruptBlockError(f"{key}: object truncated ({pos} of {n} bytes)")
        dst[pos : pos + len(chunk)] = chunk
        pos += len(chunk)


class S3Tier(S3Bulk):
    """Blocks as objects in one bucket; see the module docstring for keys, format and failure handling."""

    name = "G4"
    kind = "s3"

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

    def remember(self, key: BlockKey, nbytes: int) -> None:
        """Index a block another node wrote (learned from its event or a probe), without I/O."""
        self._index_set(key, nbytes)

    def forget(self, key: BlockKey) -> None:
        """Drop a block another node deleted from the index, without I/O."""
        self._index_drop(key)

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
        from kvbm.tiers.s3.factory import make_s3_tier

        return make_s3_tier(cfg, endpoint, credentials, **kw)

