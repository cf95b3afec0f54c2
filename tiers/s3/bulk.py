"""Many-object S3 requests (CLI, fleet tools, probes): HEAD/exists of many blocks, DeleteObjects in chunks, and
small auxiliary objects (access logs, fleet memberships)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.errors import TierUnavailableError
from kvbm.tiers.s3.codes import MISS_CODES, error_code, one_line
from kvbm.tiers.s3.session import HEADER_LEN, S3Session

DELETE_CHUNK = 1000


class S3Bulk:
    """Many-object requests (HEAD/exists probes, batch deletes) and small auxiliary objects."""

    def __init__(self, session: S3Session) -> None:
        self.session = session

    async def put_aux(self, okey: str, body: bytes) -> None:
        """PUT a small non-block object (e.g. an access log) under the prefix; raises TierUnavailableError."""
        s = self.session
        s.require_online()
        if s.parse_key(okey) is not None or not okey.startswith(s.base):
            raise ValueError(f"{okey!r} is not an auxiliary key under the prefix")
        async with s.sem:
            try:
                await s.client.put_object(Bucket=s.bucket, Key=okey, Body=body)
            except Exception as e:
                raise TierUnavailableError(f"S3 PUT {okey} at {s.endpoint_name}: {one_line(e)}") from None

    async def get_aux(self, okey: str) -> bytes | None:
        """GET a small non-block object; None when it does not exist."""
        s = self.session
        s.require_online()
        async with s.sem:
            try:
                resp = await s.client.get_object(Bucket=s.bucket, Key=okey)
                async with resp["Body"] as stream:
                    return bytes(await stream.read())
            except Exception as e:
                if error_code(e) in MISS_CODES:
                    return None
                raise TierUnavailableError(f"S3 GET {okey} at {s.endpoint_name}: {one_line(e)}") from None

    async def head_many(self, keys: Iterable[BlockKey]) -> dict[BlockKey, dict[str, Any] | None]:
        """HEAD each block (``max_concurrency`` at a time): ``{key: {size, nbytes, last_modified, metadata}}``
        or None where there is no object. Updates the index."""
        s = self.session
        s.require_online()
        sem = s.sem

        async def one(k: BlockKey) -> tuple[BlockKey, dict[str, Any] | None]:
            okey = s.object_key(k)
            async with sem:
                s.stats.heads += 1
                try:
                    r = await s.client.head_object(Bucket=s.bucket, Key=okey)
                except Exception as e:
                    if error_code(e) in MISS_CODES:
                        return k, None
                    raise TierUnavailableError(f"S3 HEAD {okey} at {s.endpoint_name}: {one_line(e)}") from None
            size = int(r["ContentLength"])
            meta = r.get("Metadata") or {}
            nb = int(meta["kvbm-nbytes"]) if str(meta.get("kvbm-nbytes", "")).isdigit() else size - HEADER_LEN
            return k, {"s3_key": okey, "size": size, "nbytes": nb, "last_modified": r.get("LastModified"),
                       "metadata": meta}

        out = dict(await asyncio.gather(*(one(k) for k in dict.fromkeys(keys))))
        for k, v in out.items():
            if v is None:
                s.objects.drop(k)
            elif v["size"] >= HEADER_LEN:
                s.objects.set(k, v["nbytes"])
        return out

    async def exists_many(self, keys: Iterable[BlockKey], concurrency: int | None = None) -> dict[BlockKey, int | None]:
        """Existence probe (HEAD, at most ``concurrency`` in flight, default ``max_concurrency``): payload bytes of
        each block the bucket holds, None for each it lacks (404). Keys whose HEAD failed otherwise are left out
        (unknown, not missing). Updates the index. Raises TierUnavailableError when the endpoint is offline or the
        circuit breaker is open (nothing was asked)."""
        s = self.session
        s.require_online()
        todo = list(dict.fromkeys(keys))
        if not todo:
            return {}
        if not s.breaker.allow():
            raise TierUnavailableError(f"S3 {s.endpoint_name}: circuit breaker open")
        sem = asyncio.Semaphore(max(1, concurrency or s.cfg.max_concurrency))
        shared = s.sem

        async def one(k: BlockKey) -> tuple[BlockKey, int | BaseException | None]:
            okey = s.object_key(k)
            async with sem, shared:
                s.stats.heads += 1
                t0 = time.perf_counter()
                try:
                    r = await s.client.head_object(Bucket=s.bucket, Key=okey)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if error_code(e) in MISS_CODES:
                        return k, None
                    return k, e
                s.observe("head", time.perf_counter() - t0)
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
            s.breaker.abandon()
            raise
        for k, v in got:
            if isinstance(v, BaseException):
                failed = v
                continue
            out[k] = v
            if v is None:
                s.objects.drop(k)
            else:
                s.objects.set(k, v)
        if failed is not None:
            s.failed("HEAD", None, failed)
        elif out:
            s.breaker.success()
        return out

    async def delete_many(self, s3_keys: Iterable[str]) -> tuple[int, list[tuple[str, str, str]]]:
        """DeleteObjects in chunks of 1000: ``(deleted, [(key, code, message), ...])``."""
        s = self.session
        s.require_online()
        keys = list(dict.fromkeys(s3_keys))
        deleted = 0
        errors: list[tuple[str, str, str]] = []
        for i in range(0, len(keys), DELETE_CHUNK):
            chunk = keys[i : i + DELETE_CHUNK]
            s.stats.delete_requests += 1
            try:
                resp = await s.client.delete_objects(
                    Bucket=s.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
                )
            except Exception as e:
                errors.extend((k, error_code(e) or type(e).__name__, one_line(e)) for k in chunk)
                continue
            failed = {err["Key"]: err for err in resp.get("Errors", ()) or ()}
            for k in chunk:
                if k in failed:
                    errors.append((k, str(failed[k].get("Code", "")), str(failed[k].get("Message", ""))))
                    continue
                deleted += 1
                bk = s.parse_key(k)
                if bk is not None:
                    s.objects.drop(bk)
        s.stats.deletes += deleted
        return deleted, errors
