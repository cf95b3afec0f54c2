"""Fleet-wide block recency: per-node access logs in the bucket.

An object's LastModified is its write time and never changes on reads, so a purge by age or budget
would delete the oldest blocks even when they are the hottest. Every daemon therefore writes, once per
``daemon.access_log_interval_s``, one small object per namespace naming the blocks it served since its
last write::

    {s3.prefix}/_access/{namespace}/{node}/{epoch}.log

``epoch`` is the unix second of the write (an upper bound of each access in it), ``node`` the writer's
``daemon.node_id`` (default: the host name). The body is a format line then one hex block hash per line.
No per-object PUT or tag per hit, any S3 works, and a block hit on many nodes in one interval costs one
line per node. :func:`read_access_times` merges the logs of a namespace into ``{hash: last access}``;
``kvbm purge`` evicts by that (least recently used first, write time where no access is recorded) and
deletes logs older than its retention; ``kvbm prewarm --hottest`` fetches the most recently used.

Compaction: a daemon keeps at most ``compact_at`` (48) of its own logs per namespace. Past that it merges
them into its newest log, rewritten as a merged log (one ``hash epoch`` line per block, its last access),
then deletes the others: the merged PUT comes first, so a crash leaves duplicates, never a lost hit, and the
merge is a max, so readers see the same times during it. Hits older than ``keep_s`` (30 days, purge's
default log retention) are dropped from a merged log. Only the writer compacts its own node's logs.

``_access`` is not a namespace (namespaces start with a letter or digit), so block listings never
mistake a log for a block, and the maintenance inventory does not count logs as foreign objects.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.blocks.keys import is_hash_hex, is_namespace

log = logging.getLogger("kvbm.fleet.recency")

ACCESS_DIR = "_access"
LOG_SUFFIX = ".log"
LOG_MAGIC = b"kvbm-access-v1\n"  # one hex hash per line; every access at the key's epoch
MERGED_MAGIC = b"kvbm-access-v2\n"  # "hex epoch" per line: a compacted log
COMPACT_AT = 48  # own logs per namespace before they are merged into one
KEEP_S = 30 * 86400.0  # hits older than this are dropped when logs are merged (purge's default retention)
MAX_PENDING = 1_000_000  # distinct hashes kept per interval; beyond it hits are dropped (counted)
_NODE_RE = re.compile(r"[^a-z0-9._-]+")

__all__ = [
    "ACCESS_DIR", "AccessLog", "AccessRecorder", "access_prefix", "decode_entries", "decode_log", "encode_log",
    "encode_merged", "is_access_key", "log_key", "node_name", "parse_log_key", "read_access_times",
]


def node_name(node_id: str = "") -> str:
    """A key-safe node name: ``node_id`` or the host name, lower case, ``[a-z0-9._-]``, at most 64 chars."""
    name = _NODE_RE.sub("-", (node_id or socket.gethostname()).lower()).strip("-.")[:64]
    return name or "node"


def _base(prefix: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


def access_prefix(prefix: str, namespace: str | None = None) -> str:
    """``{prefix}/_access/[{namespace}/]``: where the access logs (of one namespace) live."""
    out = f"{_base(prefix)}{ACCESS_DIR}/"
    return f"{out}{namespace}/" if namespace else out


def log_key(prefix: str, namespace: str, node: str, epoch: int) -> str:
    return f"{access_prefix(prefix, namespace)}{node}/{epoch}{LOG_SUFFIX}"


@dataclass(frozen=True)
class AccessLog:
    """One access-log object: its key, namespace, writer and write time (unix seconds)."""

    key: str
    namespace: str
    node: str
    epoch: int
    size: int = 0


def parse_log_key(prefix: str, okey: str, size: int = 0) -> AccessLog | None:
    """The :class:`AccessLog` an object key names, or None if it is not one."""
    base = access_prefix(prefix)
    if not okey.startswith(base):
        return None
    parts = okey[len(base) :].split("/")
    if len(parts) != 3 or not parts[2].endswith(LOG_SUFFIX):
        return None
    ns, node, name = parts
    stem = name[: -len(LOG_SUFFIX)]
    if not is_namespace(ns) or not node or node_name(node) != node or not stem.isdigit():
        return None
    return AccessLog(okey, ns, node, int(stem), size)


def is_access_key(prefix: str, okey: str) -> bool:
    """Whether ``okey`` lies under the access-log directory (a log, or a stray object there)."""
    return okey.startswith(access_prefix(prefix))


def encode_log(hashes: Iterable[bytes]) -> bytes:
    return LOG_MAGIC + b"".join(h.hex().encode() + b"\n" for h in hashes)


def encode_merged(times: dict[bytes, int]) -> bytes:
    return MERGED_MAGIC + b"".join(b"%s %d\n" % (h.hex().encode(), e) for h, e in times.items())


def decode_entries(body: bytes, epoch: int) -> list[tuple[bytes, int]]:
    """``(hash, last access)`` of a log body written at ``epoch`` (a plain log's lines all carry it; a merged
    log's lines carry their own, never later than it). An unknown format or a bad line yields nothing for it."""
    merged = body.startswith(MERGED_MAGIC)
    if not merged and not body.startswith(LOG_MAGIC):
        return []
    out = []
    for line in body[len(LOG_MAGIC) :].split(b"\n"):
        parts = line.decode("ascii", "replace").split()
        if merged and len(parts) == 2 and is_hash_hex(parts[0]) and parts[1].isdigit():
            out.append((bytes.fromhex(parts[0]), min(int(parts[1]), epoch)))
        elif not merged and len(parts) == 1 and is_hash_hex(parts[0]):
            out.append((bytes.fromhex(parts[0]), epoch))
    return out


def decode_log(body: bytes) -> list[bytes]:
    """The block hashes of a log body (plain or merged)."""
    return [h for h, _e in decode_entries(body, 0)]


class AccessRecorder:
    """Collects a daemon's hits and writes them as one access log per namespace per interval.

    :meth:`record` is called on the event loop for every onboarded run (cheap: a set insert per block, so a
    block is written at most once per interval however often it is hit); :meth:`run` flushes every
    ``interval_s`` in the background. A failed write keeps the hashes for the next try, up to
    ``MAX_PENDING``."""

    def __init__(self, tier: Any, node: str, interval_s: float, clock: Callable[[], float] = time.time, *,
                 compact_at: int = COMPACT_AT, keep_s: float = KEEP_S) -> None:
        self.tier = tier
        self.node = node_name(node)
        self.interval_s = max(1.0, float(interval_s))
        self.clock = clock
        self.pending: dict[str, dict[bytes, None]] = {}
        self.written = 0  # logs written
        self.dropped = 0  # hits beyond MAX_PENDING
        self.failed = 0  # writes that failed (their hashes were kept)
        self.compact_at = max(2, compact_at)
        self.keep_s = keep_s
        self.compacted = 0  # logs merged into a newer one and deleted
        self.compact_failed = 0
        self._own: dict[str, int] = {}  # namespace -> this node's logs in the bucket (listed once, then counted)
        self._count = 0
        self._last_epoch = 0
        self._lock = asyncio.Lock()

    def record(self, keys: Iterable[BlockKey]) -> None:
        for k in keys:
            hs = self.pending.get(k.namespace)
            if hs is None:
                hs = self.pending[k.namespace] = {}
            if k.hash in hs:
                continue
            if self._count >= MAX_PENDING:
                self.dropped += 1
                continue
            hs[k.hash] = None
            self._count += 1

    async def flush(self) -> int:
        """Write what was recorded since the last flush; returns the logs written."""
        async with self._lock:
            if not self.pending:
                return 0
            # Rounded up: an upper bound of every hit in the log (LastModified is truncated to the second, so
            # a block hit right after it was written still ranks as used after the write). One key per flush.
            batch, self.pending, self._count = self.pending, {}, 0
            try:  # this node's earlier logs (also from before a restart): counted, and never overwritten
                for ns in batch:
                    if ns not in self._own:
                        mine = await self._own_logs(ns)
                        self._own[ns] = len(mine)
                        self._last_epoch = max([self._last_epoch, *(lg.epoch for lg in mine)])
            except Exception as e:
                self.failed += 1
                log.warning("access log listing failed (%s); hits kept for the next try", e)
                for ns, hashes in batch.items():
                    self.record(BlockKey(ns, h) for h in hashes)
                return 0
            epoch = max(math.ceil(self.clock()), self._last_epoch + 1)
            self._last_epoch = epoch
            n = 0
            for ns, hashes in batch.items():
                try:
                    body = await asyncio.to_thread(encode_log, hashes)  # up to MAX_PENDING lines: off the loop
                    await self.tier.put_aux(log_key(self.tier.prefix, ns, self.node, epoch), body)
                    n += 1
                    self._own[ns] += 1
                except Exception as e:  # an outage: keep the hashes for the next interval
                    self.failed += 1
                    log.warning("access log write failed (%s); kept for the next try", e)
                    self.record(BlockKey(ns, h) for h in hashes)
                    continue
                if self._own[ns] >= self.compact_at:
                    await self._compact(ns)
            self.written += n
            return n

    async def _own_logs(self, ns: str) -> list[AccessLog]:
        return [lg for lg in await list_logs(self.tier, [ns]) if lg.node == self.node]

    async def _compact(self, ns: str) -> None:
        """Merge this node's logs of ``ns`` into its newest one; a failure leaves them all in place."""
        try:
            logs = sorted(await self._own_logs(ns), key=lambda lg: lg.epoch)
            if len(logs) < 2:
                self._own[ns] = len(logs)
                return
            newest = logs[-1]
            read = await _read_logs(self.tier, logs)
            body = await asyncio.to_thread(_merge_encoded, read, self.clock() - self.keep_s)  # millions of lines
            await self.tier.put_aux(newest.key, body)
            _deleted, errors = await self.tier.delete_many([lg.key for lg in logs[:-1]])
            self.compacted += len(logs) - 1 - len(errors)
            self._own[ns] = 1 + len(errors)
        except Exception as e:  # the logs stay as they were: nothing is lost, the next flush tries again
            self.compact_failed += 1
            log.warning("access log compaction of %s failed (%s); logs left as they are", ns, e)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    def describe(self) -> dict[str, object]:
        return {"node": self.node, "interval_s": self.interval_s, "logs_written": self.written,
                "pending": self._count, "dropped": self.dropped, "failed": self.failed,
                "logs_compacted": self.compacted, "compact_failed": self.compact_failed}


async def list_logs(tier: Any, namespaces: Iterable[str] | None = None) -> list[AccessLog]:
    """Every access log (of ``namespaces``, or of all) under the tier's prefix."""
    prefixes = [access_prefix(tier.prefix, ns) for ns in namespaces] if namespaces else [access_prefix(tier.prefix)]
    out: list[AccessLog] = []
    for pfx in dict.fromkeys(prefixes):
        async for page in tier.list_pages(pfx):
            for _bk, okey, size, _mt in page:
                lg = parse_log_key(tier.prefix, okey, size)
                if lg is not None:
                    out.append(lg)
    return out


async def read_access_times(tier: Any, namespaces: Iterable[str] | None = None, *, since: float = 0.0,
                            concurrency: int = 16) -> tuple[dict[BlockKey, float], list[AccessLog]]:
    """Merge the access logs (written after ``since``) into ``{block: last access, unix seconds}``;
    also returns every log found (old ones included, for the purge of logs)."""
    logs = await list_logs(tier, list(namespaces) if namespaces else None)
    read = await _read_logs(tier, [lg for lg in logs if lg.epoch >= since], concurrency)
    return await asyncio.to_thread(_merge_times, read, since), logs  # a key per line: off the event loop


def _merge_times(read: list[tuple[AccessLog, list[tuple[bytes, int]]]], since: float) -> dict[BlockKey, float]:
    times: dict[BlockKey, float] = {}
    for lg, entries in read:
        for h, e in entries:
            k = BlockKey(lg.namespace, h)
            if e >= since and times.get(k, 0.0) < e:
                times[k] = float(e)
    return times


def _merge_encoded(read: list[tuple[AccessLog, list[tuple[bytes, int]]]], horizon: float) -> bytes:
    """A merged log body of the logs ``read``: each hash's last access, those before ``horizon`` left out."""
    times: dict[bytes, int] = {}
    for _lg, entries in read:
        for h, e in entries:
            if e >= horizon and times.get(h, -1) < e:
                times[h] = e
    return encode_merged(times)


async def _read_logs(tier: Any, logs: list[AccessLog],
                     concurrency: int = 16) -> list[tuple[AccessLog, list[tuple[bytes, int]]]]:
    """Each log with its ``(hash, last access)`` entries; a log gone meanwhile has none."""
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(lg: AccessLog) -> tuple[AccessLog, list[tuple[bytes, int]]]:
        async with sem:
            body = await tier.get_aux(lg.key)
        return lg, await asyncio.to_thread(decode_entries, body or b"", lg.epoch)  # a line each: off the loop

    return list(await asyncio.gather(*(one(lg) for lg in logs)))

