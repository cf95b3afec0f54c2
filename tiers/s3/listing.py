"""LIST for the S3 tier: paged and parallel listings under the prefix, a namespace or a key prefix; the scan that
rebuilds the tier's index, and usage per namespace."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import time
from collections.abc import AsyncIterator
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.blocks.keys import is_namespace
from kvbm.errors import TierUnavailableError
from kvbm.tiers.base import StoredBlock
from kvbm.tiers.s3.codes import one_line
from kvbm.tiers.s3.fastlist import FAST_LIST, fast_timestamp
from kvbm.tiers.s3.session import HEADER_LEN, S3Session

LIST_PAGE = 1000  # keys per LIST page (the S3 maximum)
LIST_SERIAL_PAGES = 4  # pages of a namespace listed serially before it is split by shard directory


class S3Listing:
    """LIST: every object under the prefix, a namespace or a key prefix; scans and usage build on it."""

    def __init__(self, session: S3Session) -> None:
        self.session = session

    async def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:
        """List every block under the prefix, or one namespace of it (paging), and rebuild the index."""
        s = self.session
        s.require_online()
        started = time.monotonic()
        before = {k for k in s.objects.sizes if namespace is None or k.namespace == namespace}
        seen: set[BlockKey] = set()
        async for bkey, _okey, size, mtime in self.list_objects_parallel(namespace):
            if bkey is None or size < HEADER_LEN:
                continue
            seen.add(bkey)
            n = size - HEADER_LEN
            # seen by the time the listing began
            s.objects.set(bkey, n, max(started, s.objects.seen.get(bkey, 0.0)))
            yield StoredBlock(key=bkey, nbytes=n, mtime=mtime.timestamp() if mtime else 0.0, footprint=size)
        for k in before - seen:
            # Not listed: gone, unless this node saw it (wrote or read it) after the listing began.
            if (s.objects.seen.get(k) or 0.0) < started:
                s.objects.drop(k)

    async def list_objects(
        self, namespace: str | None = None, key_prefix: str | None = None
    ) -> AsyncIterator[tuple[BlockKey | None, str, int, _dt.datetime | None]]:
        """``(BlockKey or None for a foreign key, s3 key, size, last_modified)`` for every object under
        ``{prefix}/[{namespace}/][{key_prefix}]``; ``key_prefix`` is a raw key prefix relative to that
        (e.g. ``"llama-"`` for every namespace of a model slug, or ``"ab/"`` for one shard)."""
        s = self.session
        s.require_online()
        list_prefix = s.base
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
        s = self.session
        token: str | None = None
        parse = s.parse_key
        while True:
            kw: dict[str, Any] = {"Bucket": s.bucket, "Prefix": list_prefix, "MaxKeys": LIST_PAGE}
            if delimiter:
                kw["Delimiter"] = delimiter
            if start_after and not token:
                kw["StartAfter"] = start_after
            if token:
                kw["ContinuationToken"] = token
            fast = FAST_LIST.set(True)
            try:
                resp = await s.client.list_objects_v2(**kw)
            except Exception as e:
                raise TierUnavailableError(f"S3 LIST {list_prefix!r} at {s.endpoint_name}: {one_line(e)}") from None
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
        s = self.session
        s.require_online()
        limit = max(1, concurrency or s.cfg.list_concurrency)
        base = s.base
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
                        sharded = s.shard_chars and is_namespace(name)
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
