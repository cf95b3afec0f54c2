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
Block bodies move through a :class:`~kvbm.tiers.s3.bodies.BodyBackend` (the session's ``body``), the same way for
every client, at most ``max_concurrency`` at a time:

* ``http``: :mod:`kvbm.tiers.s3.http`, plain keep-alive HTTP(S) connections in worker threads that read
  straight into the caller's buffer and send the payload from it (no body copy), checksumming there.
* ``aiobotocore``: :mod:`kvbm.tiers.s3.aio`, the tier's shared aiobotocore client.
* ``nixl``: :mod:`kvbm.tiers.s3.nixl`, the NIXL OBJ backend (aws-sdk-cpp); its blocking calls run in a
  private thread pool.

Control calls (bucket checks, HEAD, LIST, DELETE) always use aiobotocore.

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

import datetime as _dt
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.config import S3Config
from kvbm.errors import TierUnavailableError
from kvbm.tiers.base import StoredBlock, Tier
from kvbm.tiers.s3.blocks import S3Blocks
from kvbm.tiers.s3.breaker import CircuitBreaker
from kvbm.tiers.s3.bulk import S3Bulk
from kvbm.tiers.s3.codes import one_line
from kvbm.tiers.s3.index import ObjectIndex
from kvbm.tiers.s3.listing import S3Listing
from kvbm.tiers.s3.session import HEADER_LEN, S3Session, S3Stats


class S3Tier(Tier):
    """Blocks as objects in one bucket; see the module docstring for keys, format and failure handling.

    Composed of its parts, each owning its state: :attr:`session` (client, body backend, credentials, naming,
    health), :attr:`blocks` (PUT/GET of a block, the writes in flight), :attr:`listing` (LIST, scans, usage) and
    :attr:`bulk` (many-object requests, auxiliary objects); the tier keeps its index of the bucket (``objects``)
    and its counters (``stats``), which it hands them, and the Tier interface over them."""

    name = "G4"
    kind = "s3"

    def __init__(
        self,
        cfg: S3Config | None = None,
        *,
        endpoint: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        capacity_bytes: int | None = None,
        bucket: str | None = None,
        prefix: str | None = None,
        client: str | None = None,
        wait_for_endpoint: bool = False,
    ) -> None:
        cfg = cfg or S3Config()
        super().__init__(cfg.capacity if capacity_bytes is None else capacity_bytes)
        self.stats: S3Stats = S3Stats()
        self.objects = ObjectIndex(HEADER_LEN, cfg.copy_max_age_s)  # sizes and sightings of the bucket's blocks
        self.session = S3Session(cfg, objects=self.objects, stats=self.stats, endpoint=endpoint,
                                 credentials=(access_key, secret_key, session_token), bucket=bucket, prefix=prefix,
                                 client=client, wait_for_endpoint=wait_for_endpoint)
        self.listing = S3Listing(self.session)
        self.bulk = S3Bulk(self.session)
        s = self.session
        self.cfg, self.endpoint, self.bucket, self.prefix = cfg, s.endpoint, s.bucket, s.prefix
        self.client_kind, self.shard_chars = s.client_kind, s.shard_chars
        self.breaker: CircuitBreaker = s.breaker
        self.blocks = S3Blocks(self.session)

    # -- the session's state, read through ------------------------------------------------------
    @property
    def endpoint_name(self) -> str:
        return self.session.endpoint_name

    @property
    def online(self) -> bool:
        return self.session.online

    @property
    def last_error(self) -> str:
        return self.session.last_error

    @property
    def observe(self) -> Callable[[str, float], None]:
        """(op, seconds) per successful request; the daemon sets it (kvbm.daemon.metrics)."""
        return self.session.observe

    @observe.setter
    def observe(self, fn: Callable[[str, float], None]) -> None:
        self.session.observe = fn

    def object_key(self, key: BlockKey) -> str:
        return self.session.object_key(key)

    def parse_key(self, s3_key: str) -> BlockKey | None:
        """The BlockKey an object key names, or None for a key this scheme did not write."""
        return self.session.parse_key(s3_key)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.session.started:
            return
        await self.session.start()
        if self.cfg.scan_on_start and self.online:
            async for _ in self.scan():
                pass

    async def close(self) -> None:
        await self.session.close()

    def writable(self) -> bool:
        return self.blocks.writable()

    # -- index (kvbm.tiers.s3.index) --------------------------------------------------------------
    def seen_within(self, key: BlockKey, max_age_s: float | None = None) -> bool:
        return self.objects.seen_within(key, max_age_s)

    def nbytes(self, key: BlockKey) -> int | None:
        return self.objects.sizes.get(key)

    def footprint(self, nbytes: int) -> int:
        return nbytes + HEADER_LEN

    def used_bytes(self) -> int:
        return self.objects.used

    # -- LIST and many-object requests: the listing's and the bulk mover's ---------------------------
    def scan(self, namespace: str | None = None) -> AsyncIterator[StoredBlock]:
        """List every block under the prefix, or one namespace of it, and rebuild the index."""
        return self.listing.scan(namespace)

    def list_objects(self, namespace: str | None = None, key_prefix: str | None = None
                     ) -> AsyncIterator[tuple[BlockKey | None, str, int, _dt.datetime | None]]:
        return self.listing.list_objects(namespace, key_prefix)

    def list_pages(self, list_prefix: str, delimiter: str = "", dirs: list[str] | None = None, start_after: str = ""
                   ) -> AsyncIterator[list[tuple[BlockKey | None, str, int, _dt.datetime | None]]]:
        return self.listing.list_pages(list_prefix, delimiter, dirs, start_after)

    def list_objects_parallel(self, namespace: str | None = None, concurrency: int | None = None
                              ) -> AsyncIterator[tuple[BlockKey | None, str, int, _dt.datetime | None]]:
        return self.listing.list_objects_parallel(namespace, concurrency)

    async def usage(self) -> dict[str, dict[str, Any]]:
        return await self.listing.usage()

    async def put_aux(self, okey: str, body: bytes) -> None:
        await self.bulk.put_aux(okey, body)

    async def get_aux(self, okey: str) -> bytes | None:
        return await self.bulk.get_aux(okey)

    async def head_many(self, keys: Iterable[BlockKey]) -> dict[BlockKey, dict[str, Any] | None]:
        return await self.bulk.head_many(keys)

    async def exists_many(self, keys: Iterable[BlockKey], concurrency: int | None = None) -> dict[BlockKey, int | None]:
        return await self.bulk.exists_many(keys, concurrency)

    async def delete_many(self, s3_keys: Iterable[str]) -> tuple[int, list[tuple[str, str, str]]]:
        return await self.bulk.delete_many(s3_keys)

    # -- data path: the block mover's -------------------------------------------------------------
    async def put(self, key: BlockKey, data: memoryview | bytes) -> None:
        await self.blocks.put(key, data, self.capacity_bytes)

    async def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        return await self.blocks.get_into(key, out)

    async def delete(self, key: BlockKey) -> bool:
        self.session.require_online()
        okey = self.object_key(key)
        existed = key in self.objects.sizes
        try:
            if not existed:
                existed = await self.session.head_size(okey) is not None
            self.stats.delete_requests += 1
            await self.session.client.delete_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            self.stats.errors += 1
            raise TierUnavailableError(f"S3 DELETE {okey} at {self.endpoint_name}: {one_line(e)}") from None
        self.objects.drop(key)
        if existed:
            self.stats.deletes += 1
        return existed

    async def delete_blocks(self, keys: Sequence[BlockKey], *, gone: bool = False) -> int:
        """:meth:`delete` of many: DeleteObjects of 1,000 keys a request and no HEAD (a key the index lacks is
        deleted all the same, idempotently); with ``gone`` (a purge already deleted them) no request at all."""
        held = sum(k in self.objects.sizes for k in keys)
        if gone:
            for k in keys:
                self.objects.drop(k)
            return held
        self.session.require_online()
        _deleted, errors = await self.delete_many([self.object_key(k) for k in keys])
        if errors:
            self.stats.errors += len(errors)
            key, code, msg = errors[0]
            raise TierUnavailableError(f"S3 DeleteObjects at {self.endpoint_name}: {len(errors)} keys failed, e.g. "
                                       f"{key}: {code} {msg}".strip())
        return held

    def remember(self, key: BlockKey, nbytes: int) -> None:
        """Index a block another node wrote (learned from its event or a probe), without I/O. It is not marked
        seen here: a probe's HEAD already did that (:meth:`exists_many`), an event alone does not."""
        self.objects.hearsay(key, nbytes)

    def forget(self, key: BlockKey) -> None:
        """Drop a block another node deleted from the index, without I/O."""
        self.objects.drop(key)

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.update(
            endpoint=self.endpoint_name, bucket=self.bucket, prefix=self.prefix, client=self.client_kind,
            breaker=self.breaker.describe(), online=self.online, last_error=self.last_error,
            pending_writes=self.blocks.pending_writes, indexed_blocks=len(self.objects.sizes),
        )
        return d

