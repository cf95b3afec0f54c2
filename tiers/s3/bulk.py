"""Bulk S3 operations (CLI, fleet tools, scans): paged and parallel LIST, usage per namespace, HEAD/exists
probes of many blocks, DeleteObjects in chunks, and small auxiliary objects (access logs)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from kvbm.blocks import (
    BlockKey,
)
from kvbm.blocks.keys import is_namespace
from kvbm.errors import TierUnavailableError
from kvbm.tiers.base import StoredBlock
from kvbm.tiers.s3.codes import MISS_CODES, error_code, one_line
from kvbm.tiers.s3.fastlist import FAST_LIST, fast_timestamp
from kvbm.tiers.s3.session import HEADER_LEN, S3Session

log = logging.getLogger("kvbm.tiers.s3")

DELETE_CHUNK = 1000

LIST_PAGE = 1000  # keys per LIST page (the S3 maximum)
LIST_SERIAL_PAGES = 4  # pages of a namespace listed serially before it is split by shard directory


class S3Listing(S3Session):
    """LIST: every object under the prefix, a namespace or a key prefix; scans and usage build on it."""

    async def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:  # type: ignore[override]
        """List every block under the prefix, or one namespace of it (paging), and rebuild the index."""
        self._require_online()
        started = time.monotonic()
        before = {k for k in self.objects.sizes if namespace is None or k.namespace == namespace}
        seen: set[BlockKey] = set()
        async for bkey, _okey, size, mtime in self.list_objects_parallel(namespace):
            if bkey is None or size < HEADER_LEN:
                continue
            seen.add(bkey)
            n = size - HEADER_LEN
            # seen by the time the listing began
            self.objects.set(bkey, n, max(started, self.objects.seen.get(bkey, 0.0)))
            yield StoredBlock(key=bkey, nbytes=n, mtime=mtime.timestamp() if mtime else 0.0, footprint=size)
        for k in before - seen:
            # Not listed: gone, unless this node saw it (wrote or read it) after the listing began.
            if (self.objects.seen.get(k) or 0.0) < started:
                self.objects.drop(k)


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
        async for page in self.list_pages(list_prefix):
            for entry in page:
                yield entry

    async def list_pages(
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
            fast = FAST_LIST.set(True)
            try:
                resp = await self._s3.list_objects_v2(**kw)
            except Exception as e:
                raise TierUnavailableError(f"S3 LIST {list_prefix!r} at {self.endpoint_name}: {one_line(e)}") from None
            finally:
                FAST_LIST.reset(fast)
            if dirs is not None:
                dirs.extend(cp["Prefix"] for cp in resp.get("CommonPrefixes", ()) or ())
            fast = resp.get("KvbmContents")
            if fast is not None:  # parsed by fast_list_contents
                yield [(parse(k), k, size, fast_timestamp(mt) if mt else None) for k, size, mt in fast]
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
                async for page in self.list_pages(prefix, delimiter, dirs, after):
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
                async for page in self.list_pages(ns_prefix, "/", dirs):
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


class S3Bulk(S3Listing):
    """Many-object requests (HEAD/exists probes, batch deletes) and small auxiliary objects."""

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
                raise TierUnavailableError(f"S3 PUT {okey} at {self.endpoint_name}: {one_line(e)}") from None

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
                if error_code(e) in MISS_CODES:
                    return None
                raise TierUnavailableError(f"S3 GET {okey} at {self.endpoint_name}: {one_line(e)}") from None

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
                    if error_code(e) in MISS_CODES:
                        return k, None
                    raise TierUnavailableError(f"S3 HEAD {okey} at {self.endpoint_name}: {one_line(e)}") from None
            size = int(r["ContentLength"])
            meta = r.get("Metadata") or {}
            nb = int(meta["kvbm-nbytes"]) if str(meta.get("kvbm-nbytes", "")).isdigit() else size - HEADER_LEN
            return k, {"s3_key": okey, "size": size, "nbytes": nb, "last_modified": r.get("LastModified"),
                       "metadata": meta}

        out = dict(await asyncio.gather(*(one(k) for k in dict.fromkeys(keys))))
        for k, v in out.items():
            if v is None:
                self.objects.drop(k)
            elif v["size"] >= HEADER_LEN:
                self.objects.set(k, v["nbytes"])
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
                    if error_code(e) in MISS_CODES:
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
            self.breaker.abandon()
            raise
        for k, v in got:
            if isinstance(v, BaseException):
                failed = v
                continue
            out[k] = v
            if v is None:
                self.objects.drop(k)
            else:
                self.objects.set(k, v)
        if failed is not None:
            self._failed("HEAD", None, failed)
        elif out:
            self.breaker.success()
        return out

    async def delete_many(self, s3_keys: Iterable[str]) -> tuple[int, list[tuple[str, str, str]]]:
        """DeleteObjects in chunks of 1000: ``(deleted, [(key, code, message), ...])``."""
        self._require_online()
        keys = list(dict.fromkeys(s3_keys))
        deleted = 0
        errors: list[tuple[str, str, str]] = []
        for i in range(0, len(keys), DELETE_CHUNK):
            chunk = keys[i : i + DELETE_CHUNK]
            self.stats.delete_requests += 1
            try:
                resp = await self._s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
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
                bk = self.parse_key(k)
                if bk is not None:
                    self.objects.drop(bk)
        self.stats.deletes += deleted
        return deleted, errors
