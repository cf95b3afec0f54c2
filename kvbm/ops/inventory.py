"""Inventory: walk the disk tier's directory and list the bucket, one :class:`Entry` per kvbm block.

Only names that parse as kvbm block keys are ever yielded: ``<namespace>/<hh>/<hash>.kvb`` regular files
(never symlinks) under the disk dir, and keys that :meth:`S3Tier.parse_key` accepts under the configured
prefix. Anything else (foreign objects sharing the bucket, temp files, stray files) is counted as foreign at
most and is never selected, whatever the filter. :class:`Selector` narrows by namespace / model slug / key
prefix (the *scope*) and carries the purge criteria (age, ``--all``, a byte budget).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import os
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.blocks.keys import check_namespace, is_namespace, model_slug, parse_disk_relpath
from kvbm.config import Config
from kvbm.errors import ConfigError
from kvbm.fleet.members import is_member_key
from kvbm.fleet.recency import is_access_key

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", re.IGNORECASE)
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- parsing ---------------------------------------------------------------------------------------------
def parse_duration(text: str) -> float:
    """``7d`` / ``12h`` / ``90m`` / ``45s`` / ``2w`` / ``1d12h`` / ``3600`` (seconds) -> seconds."""
    s = str(text).strip().lower().replace(" ", "")
    if not s:
        raise ConfigError("empty duration (e.g. 7d, 12h, 30m, 45s, 2w)")
    total = 0.0
    pos = 0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise ConfigError(f"cannot read {text!r} as a duration (e.g. 7d, 12h, 30m, 45s, 2w, 1d12h)")
    return total


# -- inventory -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One stored block: where (``disk`` or ``bucket``), its key, its path or object key, size and mtime."""

    store: str
    key: BlockKey
    ref: str
    size: int
    mtime: float
    accessed: float = 0.0  # last access any node recorded in the bucket's access logs (0: none)

    @property
    def namespace(self) -> str:
        return self.key.namespace

    @property
    def last_used(self) -> float:
        """The later of the write time and the last recorded access: what purge ages and ranks by."""
        return max(self.mtime, self.accessed)


@dataclass
class Selector:
    """Scope (``namespaces``, ``model``, ``prefix``) plus purge criteria (``older_than_s``, ``all``,
    ``max_bytes``). ``prefix`` matches the key relative to kvbm's own prefix,
    ``<namespace>/<shard>/<hash hex>`` (disk files are matched by the same name)."""

    namespaces: tuple[str, ...] = ()
    model: str | None = None
    prefix: str | None = None
    older_than_s: float | None = None
    all: bool = False
    max_bytes: int | None = None
    shard_chars: int = 2

    def __post_init__(self) -> None:
        for ns in self.namespaces:
            check_namespace(ns)
        if self.model is not None:
            self.model = model_slug(self.model)
        if self.prefix is not None:
            self.prefix = self.prefix.lstrip("/")

    @property
    def has_criterion(self) -> bool:
        return self.all or self.older_than_s is not None or self.max_bytes is not None or bool(self.prefix)

    def relkey(self, key: BlockKey) -> str:
        h = key.hex
        return f"{key.namespace}/{h[: self.shard_chars]}/{h}" if self.shard_chars else f"{key.namespace}/{h}"

    def ns_in_scope(self, ns: str) -> bool:
        if self.namespaces and ns not in self.namespaces:
            return False
        return not (self.model is not None and ns.rsplit("-", 1)[0] != self.model)

    def in_scope(self, e: Entry) -> bool:
        if not self.ns_in_scope(e.namespace):
            return False
        return not (self.prefix and not self.relkey(e.key).startswith(self.prefix))

    def list_prefixes(self) -> list[tuple[str | None, str | None]]:
        """``(namespace, key_prefix)`` pairs for :meth:`S3Tier.list_objects` covering the scope."""
        if self.prefix:
            return [(None, self.prefix)]
        if self.namespaces:
            return [(ns, None) for ns in dict.fromkeys(self.namespaces)]
        if self.model is not None:
            return [(None, f"{self.model}-")]
        return [(None, None)]


def iter_disk(root: str | os.PathLike[str], sel: Selector | None = None) -> Iterator[Entry]:
    """Every kvbm block file under ``root`` in scope of ``sel`` (regular files only; symlinks and foreign
    names are skipped)."""
    sel = sel or Selector()
    root = Path(root)
    try:
        tops = list(os.scandir(root))
    except FileNotFoundError:
        return
    for top in tops:
        ns = top.name
        if not is_namespace(ns) or not top.is_dir(follow_symlinks=False) or not sel.ns_in_scope(ns):
            continue
        for shard in _scandir(top.path):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for f in _scandir(shard.path):
                key = parse_disk_relpath((ns, shard.name, f.name))
                if key is None:
                    continue
                try:
                    if not f.is_file(follow_symlinks=False):
                        continue
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                e = Entry("disk", key, f.path, st.st_size, st.st_mtime)
                if sel.in_scope(e):
                    yield e


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


async def open_bucket(cfg: Config, *, start_embedded: bool = True) -> Any:
    """A started :class:`S3Tier` for ``cfg`` that never creates a bucket.

    An explicit ``s3.endpoint`` is used as is; an empty one means the embedded SeaweedFS (started or
    reused; without ``start_embedded`` only reused, and None when it is not running) when
    ``embedded_s3.enabled``, else AWS S3. Raises ConfigError (credentials, missing bucket) or
    TierUnavailableError (unreachable endpoint)."""
    import msgspec

    from kvbm.tiers.s3 import make_s3_tier

    if not cfg.s3.enabled:
        raise ConfigError("the S3 tier is disabled (s3.enabled: false)")
    s3cfg = msgspec.structs.replace(cfg.s3, create_bucket=False, scan_on_start=False)
    endpoint = cfg.s3.endpoint or None
    creds = None
    if endpoint is None and cfg.embedded_s3.enabled:
        from kvbm.s3server import running_from_config
        from kvbm.stack import start_embedded_s3

        if start_embedded:
            emb = await asyncio.to_thread(start_embedded_s3, cfg)
        else:
            emb = await asyncio.to_thread(running_from_config, cfg.embedded_s3, cfg.s3.bucket)
            if emb is None:
                return None
        endpoint, creds = emb.endpoint, (emb.access_key, emb.secret_key)
    tier = make_s3_tier(s3cfg, endpoint, creds)
    await tier.start()
    return tier


async def iter_bucket(tier: Any, sel: Selector | None = None, foreign: list[int] | None = None) -> AsyncIterator[Entry]:
    """Every kvbm block object in scope of ``sel``; objects that do not parse as block keys are counted in
    ``foreign[0]`` (when given) and never yielded."""
    sel = sel or Selector(shard_chars=tier.shard_chars)
    for ns, kp in sel.list_prefixes():
        # A namespace or the whole prefix is listed by shard directory, concurrently; a raw key prefix serially.
        listing = tier.list_objects(namespace=ns, key_prefix=kp) if kp else tier.list_objects_parallel(ns)
        async for bkey, okey, size, mtime in listing:
            if bkey is None or tier.object_key(bkey) != okey:
                own = is_access_key(tier.prefix, okey) or is_member_key(tier.prefix, okey)  # logs, memberships
                if foreign is not None and not own:
                    foreign[0] += 1
                continue
            e = Entry("bucket", bkey, okey, size, mtime.timestamp() if mtime else 0.0)
            if sel.in_scope(e):
                yield e


def summarize(entries: Iterable[Entry]) -> dict[str, dict[str, Any]]:
    """Per namespace ``{objects, bytes, oldest, newest}`` (unix seconds) plus ``"*"`` for the total."""
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        for ns in (e.namespace, "*"):
            u = out.setdefault(ns, {"objects": 0, "bytes": 0, "oldest": None, "newest": None})
            u["objects"] += 1
            u["bytes"] += e.size
            if e.mtime:
                u["oldest"] = e.mtime if u["oldest"] is None else min(u["oldest"], e.mtime)
                u["newest"] = e.mtime if u["newest"] is None else max(u["newest"], e.mtime)
    out.setdefault("*", {"objects": 0, "bytes": 0, "oldest": None, "newest": None})
    return out


def iso(ts: float | None) -> str | None:
    if not ts:
        return None
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_access(entries: Iterable[Entry], times: dict[BlockKey, float]) -> list[Entry]:
    """``entries`` with ``accessed`` set from merged access logs (:func:`kvbm.fleet.recency.read_access_times`)."""
    return [dataclasses.replace(e, accessed=times[e.key]) if e.key in times else e for e in entries]
