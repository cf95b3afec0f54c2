"""The S3 tier's block data path: one block written (PUT) or read (GET) through the session's body backend, with
the shedding, breaker and index bookkeeping around each (:class:`~kvbm.tiers.s3.tier.S3Tier` holds one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvbm.blocks import FORMAT_VERSION, BlockKey
from kvbm.errors import CorruptBlockError, TierFullError, TierUnavailableError, WriteShedError
from kvbm.tiers.s3.codes import one_line
from kvbm.tiers.s3.session import HEADER_LEN, S3Session

log = logging.getLogger("kvbm.tiers.s3")

META_FORMAT = f"kvbm-block-v{FORMAT_VERSION}"


class S3Blocks:
    """PUT and GET of blocks; owns the count of writes in flight (``s3.max_pending_writes``)."""

    def __init__(self, session: S3Session) -> None:
        self.session = session
        self._pending = 0

    @property
    def pending_writes(self) -> int:
        return self._pending

    def writable(self) -> bool:
        s = self.session
        return s.online and self._pending < s.cfg.max_pending_writes and s.breaker.would_allow()

    def _meta(self, key: BlockKey, nbytes: int) -> dict[str, str]:
        return {
            "kvbm-format": META_FORMAT,
            "kvbm-namespace": key.namespace,
            "kvbm-hash": key.hash.hex(),
            "kvbm-nbytes": str(nbytes),
            "kvbm-created": f"{time.time():.3f}",
        }

    def _shed(self, key: BlockKey, why: str) -> WriteShedError:
        s = self.session
        s.stats.shed += 1
        return WriteShedError(f"G4 S3 {s.endpoint_name}: write of {key} shed ({why})")

    async def put(self, key: BlockKey, data: memoryview | bytes, capacity_bytes: int) -> None:
        """Write one block; raises TierFullError past ``capacity_bytes`` (0: none), WriteShedError when shed,
        TierUnavailableError when the write failed."""
        s = self.session
        s.require_started()
        n = memoryview(data).nbytes
        fp = n + HEADER_LEN
        old = s.objects.sizes.get(key)
        if old is None and capacity_bytes and s.objects.used + fp > capacity_bytes:
            raise TierFullError(f"G4 S3: {s.objects.used + fp} bytes would exceed capacity {capacity_bytes}")
        if not s.online:
            raise self._shed(key, f"endpoint not reachable yet: {s.last_error}")
        if self._pending >= s.cfg.max_pending_writes:
            raise self._shed(key, f"{self._pending} writes in flight, s3.max_pending_writes")
        if not s.breaker.allow():
            raise self._shed(key, "circuit breaker open")
        self._pending += 1
        try:
            okey = s.object_key(key)
            async with s.sem:
                t0 = time.perf_counter()
                await s.body.put(okey, key, memoryview(data), self._meta(key, n))
                s.observe("put", time.perf_counter() - t0)
        except (asyncio.CancelledError, KeyboardInterrupt):
            s.breaker.abandon()
            raise
        except Exception as e:
            s.failed("PUT", key, e)
            raise TierUnavailableError(f"S3 PUT of {key} at {s.endpoint_name} failed: {one_line(e)}") from None
        finally:
            self._pending -= 1
        s.breaker.success()
        s.objects.set(key, n)
        s.stats.puts += 1
        s.stats.bytes_in += n

    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        """Read one block into ``out``: its payload bytes, or None for a miss (corrupt, gone, failed, offline)."""
        s = self.session
        s.require_started()
        s.stats.gets += 1
        if not s.online or not s.breaker.allow():
            s.stats.misses += 1
            return None
        okey = s.object_key(key)
        view = memoryview(out).cast("B")
        expected = s.objects.sizes.get(key)  # the length the caller sized ``out`` (and a G2 slot) by
        try:
            async with s.sem:
                t0 = time.perf_counter()
                n = await s.body.get_into(okey, key, view)
                s.observe("get", time.perf_counter() - t0)
        except (asyncio.CancelledError, KeyboardInterrupt):
            s.breaker.abandon()
            raise
        except CorruptBlockError as e:
            s.breaker.success()
            log.warning("corrupt S3 object %s: %s (deleted)", okey, e)
            s.stats.corrupt += 1
            s.stats.misses += 1
            s.objects.drop(key)
            with contextlib.suppress(Exception):
                await s.client.delete_object(Bucket=s.bucket, Key=okey)
            return None
        except ValueError:
            raise
        except Exception as e:
            s.failed("GET", key, e)
            s.stats.misses += 1
            return None
        s.breaker.success()
        if n is None:
            s.objects.drop(key)
            s.stats.misses += 1
            return None
        if expected is not None and n != expected:
            # A valid block of another length (overwritten since it was indexed): what the caller sized its
            # buffer or slot by is not what is there, so nothing of it is served. Forgotten: a miss, recomputed.
            log.warning("S3 object %s holds %d payload bytes, %d indexed: refused", okey, n, expected)
            s.stats.short_reads += 1
            s.stats.misses += 1
            s.objects.drop(key)
            return None
        s.objects.set(key, n)
        s.stats.hits += 1
        s.stats.bytes_out += n
        return n
