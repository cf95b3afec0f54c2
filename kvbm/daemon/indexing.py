"""Indexing the bucket (G4) apart from the other tiers: S3 being down must not stop G2/G3 serving.

``daemon.index_bucket``: ``start`` lists it before serving (then in the background if that fails),
``background`` lists it while serving, ``lazy`` lists only each worker's namespace at its first Register.
Failed listings are retried with backoff; until one completes the snapshot says ``bucket_indexed: false``.

A lazy start after a crash (the owed-write journal may lack what was owed, :mod:`kvbm.manager.owed`) also lists,
in the background, each namespace the disk holds, so the start-up reconcile covers the namespaces no worker
registers again; once all are listed the disk counts as reconciled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvbm.daemon.logs import logj
from kvbm.daemon.transport import Spawn
from kvbm.errors import TierUnavailableError
from kvbm.manager.core import BlockManager

INDEX_RETRY_S = (0.5, 10.0)  # bucket listing retries: first delay, cap (doubling in between)
MAX_NAMESPACES = 4096  # namespaces remembered as listed one by one (beyond: the oldest is listed again when used)


class BucketIndexer:
    """Owns whether (and which namespaces of) the bucket are indexed, and the retries until they are.

    Per-namespace state is bounded: the namespaces indexed one by one are remembered up to
    :data:`MAX_NAMESPACES` (the oldest forgotten first: a later Register lists it again), one listing per
    namespace runs at a time (its entry gone when it ends), and one retry loop serves every namespace whose
    listing failed while a registered worker still uses it (``wanted``)."""

    def __init__(self, manager: BlockManager, mode: str, spawn: Spawn,
                 wanted: Callable[[str], bool] = lambda _ns: True) -> None:
        self.manager = manager
        self.mode = mode
        self.indexed = asyncio.Event()
        self.error = ""  # why the last listing failed (until one completes)
        self.namespaces: dict[str, None] = {}  # indexed one by one (before the whole bucket was), oldest first
        self.pending: set[str] = set()  # namespaces whose listing failed, retried while wanted
        self._spawn = spawn
        self._wanted = wanted
        self._names = [t.name for t in manager.tiers if t.kind == "s3"]
        self._listing: dict[str, asyncio.Future[None]] = {}  # namespace -> its listing in progress
        self._retry: asyncio.Task[None] | None = None
        self._disk_spaces: set[str] = set()  # a lazy start's namespaces on disk still to reconcile (kept retrying)

    async def start(self) -> None:
        """Before serving: list the bucket now (``start``) or note that there is none to list."""
        if not self._names:
            self.indexed.set()
        elif self.mode == "start":
            try:
                await self._list()
            except TierUnavailableError as e:
                self._failed(e, INDEX_RETRY_S[0])

    def serve(self) -> None:
        """While serving: list the bucket in the background unless it is listed or lazily indexed."""
        if self._names and not self.indexed.is_set() and self.mode != "lazy":
            self._spawn(self._index_bucket())
        elif self._names and self.mode == "lazy" and not self.manager.owed_writes.settled:
            self._spawn(self._reconcile_disk())

    async def _reconcile_disk(self) -> None:
        """A lazy start after a crash: list every namespace the disk holds (each one reconciled with the disk)."""
        self._disk_spaces = await self.manager.index.local_namespaces()
        for ns in sorted(self._disk_spaces):
            await self.index_namespace(ns)  # one that fails is retried while it is in _disk_spaces
        if not self._disk_spaces:
            self.manager.owed_writes.settle()

    async def _list(self) -> None:
        """List the whole bucket once (raises TierUnavailableError if it cannot be listed to the end)."""
        t0 = time.perf_counter()
        blocks = 0
        for name in self._names:
            blocks += await self.manager.index_tier(name)
        self.error = ""
        self.indexed.set()
        self.pending.clear()
        logj("bucket.indexed", blocks=blocks, seconds=round(time.perf_counter() - t0, 3))

    def _failed(self, e: Exception, retry_s: float, namespace: str = "") -> None:
        first = str(e) != self.error
        self.error = str(e)
        logj("bucket.index_failed", level=logging.WARNING if first else logging.DEBUG, error=str(e),
             namespace=namespace or None, retry_s=retry_s)

    async def _index_bucket(self) -> None:
        """List the whole bucket in the background (lookups find G4 blocks as their pages arrive), retrying
        with backoff until a listing completes."""
        delay, cap = INDEX_RETRY_S
        while not self.indexed.is_set():
            try:
                await self._list()
            except TierUnavailableError as e:
                self._failed(e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)

    async def index_namespace(self, namespace: str, wait_s: float | None = None) -> bool:
        """Before a worker's first Registered reply: list its namespace in the bucket (once). If S3 cannot
        be listed now the worker is registered anyway and the namespace is listed later. ``wait_s``: wait no
        longer than that (a slow S3) and leave the listing running; returns whether it is done."""
        if self.indexed.is_set() or namespace in self.namespaces:
            return True
        listing = self._listing.get(namespace)
        if listing is None:
            listing = self._listing[namespace] = self._spawn(self._list_namespace(namespace))
            listing.add_done_callback(lambda _f: self._listing.pop(namespace, None))
        if wait_s is None:
            await asyncio.shield(listing)
            return True
        await asyncio.wait({listing}, timeout=wait_s)
        return listing.done()

    async def _list_namespace(self, namespace: str) -> None:
        try:
            for name in self._names:
                await self.manager.index_tier(name, namespace)
        except TierUnavailableError as e:
            self._failed(e, INDEX_RETRY_S[0], namespace)
            self.pending.add(namespace)
            if self._retry is None:
                self._retry = self._spawn(self._retry_pending())
            return
        self.pending.discard(namespace)
        self.namespaces[namespace] = None
        if namespace in self._disk_spaces:
            self._disk_spaces.discard(namespace)
            if not self._disk_spaces:
                self.manager.owed_writes.settle()
        while len(self.namespaces) > MAX_NAMESPACES:
            del self.namespaces[next(iter(self.namespaces))]
        if not self.pending:
            self.error = ""

    async def _retry_pending(self) -> None:
        """One loop for every failed namespace: each pass (after a backoff) drops those no worker uses any more
        and lists the others until one fails (S3 still down: the rest wait for the next pass)."""
        delay, cap = INDEX_RETRY_S
        try:
            while self.pending and not self.indexed.is_set():
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                self.pending = {ns for ns in self.pending if self._wanted(ns) or ns in self._disk_spaces}
                for ns in list(self.pending):
                    await self.index_namespace(ns)
                    if ns in self.pending:
                        break
        finally:
            self._retry = None
