"""Indexing the bucket (G4) apart from the other tiers: S3 being down must not stop G2/G3 serving.

``daemon.index_bucket``: ``start`` lists it before serving (then in the background if that fails),
``background`` lists it while serving, ``lazy`` lists only each worker's namespace at its first Register.
Failed listings are retried with backoff; until one completes the snapshot says ``bucket_indexed: false``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvbm.daemon.logs import logj
from kvbm.daemon.transport import Spawn
from kvbm.errors import TierUnavailableError
from kvbm.manager.core import BlockManager

INDEX_RETRY_S = (0.5, 10.0)  # bucket listing retries: first delay, cap (doubling in between)


class BucketIndexer:
    """Owns whether (and which namespaces of) the bucket are indexed, and the retries until they are."""

    def __init__(self, manager: BlockManager, mode: str, spawn: Spawn) -> None:
        self.manager = manager
        self.mode = mode
        self.indexed = asyncio.Event()
        self.error = ""  # why the last listing failed (until one completes)
        self.namespaces: set[str] = set()  # indexed one by one (before the whole bucket was)
        self._spawn = spawn
        self._names = [t.name for t in manager.tiers if t.kind == "s3"]
        self._retrying: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}

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

    async def _list(self) -> None:
        """List the whole bucket once (raises TierUnavailableError if it cannot be listed to the end)."""
        t0 = time.perf_counter()
        blocks = 0
        for name in self._names:
            blocks += await self.manager.index_tier(name)
        self.error = ""
        self.indexed.set()
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

    async def index_namespace(self, namespace: str) -> None:
        """Before a worker's first Registered reply: list its namespace in the bucket (once). If S3 cannot
        be listed now the worker is registered anyway and the namespace is listed later."""
        if self.indexed.is_set() or namespace in self.namespaces:
            return
        async with self._locks.setdefault(namespace, asyncio.Lock()):
            if namespace in self.namespaces:
                return
            try:
                for name in self._names:
                    await self.manager.index_tier(name, namespace)
            except TierUnavailableError as e:
                self._failed(e, INDEX_RETRY_S[0], namespace)
                if namespace not in self._retrying:
                    self._retrying.add(namespace)
                    self._spawn(self._retry_namespace(namespace))
                return
            self.namespaces.add(namespace)
            if not self._retrying - {namespace}:
                self.error = ""

    async def _retry_namespace(self, namespace: str) -> None:
        delay, cap = INDEX_RETRY_S
        try:
            while namespace not in self.namespaces and not self.indexed.is_set():
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                await self.index_namespace(namespace)
        finally:
            self._retrying.discard(namespace)
