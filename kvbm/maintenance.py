"""Storage maintenance behind ``kvbm status``, ``kvbm purge`` and ``kvbm prewarm``.

The CLI only parses options and prints; everything that decides *what* to touch lives here:

* **Inventory**: walk the disk tier's directory and list the bucket, yielding one :class:`Entry` per kvbm
  block. Only names that parse as kvbm block keys are ever yielded: ``<namespace>/<hh>/<hash>.kvb`` regular
  files (never symlinks) under the disk dir, and keys that :meth:`S3Tier.parse_key` accepts under the
  configured prefix. Anything else (foreign objects sharing the bucket, temp files, stray files) is counted
  as foreign at most and is never selected, whatever the filter.
* **Selection**: :class:`Selector` narrows by namespace / model slug / key prefix (the *scope*) and picks
  by age, ``--all`` or a byte budget (the *criteria*). :func:`plan_purge` applies the budget per
  (store, namespace), deleting oldest first.
* **Deletion**: batched (``DELETE_BATCH`` keys per DeleteObjects request), idempotent (a key already gone
  is not an error), re-checked against the key scheme just before each request.
* **Prewarm**: turn a namespace, a list of hashes or token-id prompts into block keys, find what the
  bucket holds (HEAD/LIST), and copy it into the disk tier with bounded concurrency, or have a running
  daemon onboard it into its host tier.
* **Daemon link**: a short-lived, registration-only client (no shared-memory mapping) for Stats, Evict
  and Onboard/Release; it registers with the admin token and CURVE client keys of the config
  (:meth:`DaemonLink.for_config`), so the daemon lets it evict and onboard any namespace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import json
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.config import Config, parse_size
from kvbm.errors import ConfigError, KvbmError
from kvbm.keys import DISK_SUFFIX, check_namespace, is_hash_hex, is_namespace, model_slug, parse_disk_relpath
from kvbm.recency import AccessLog, is_access_key

DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", re.IGNORECASE)
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

__all__ = [
    "DELETE_BATCH", "DaemonLink", "DeleteResult", "Entry", "PrewarmReport", "Selector", "daemon_reachable",
    "delete_bucket", "delete_disk", "iter_bucket", "iter_disk", "keys_from_hashes_file", "keys_from_tokens_file",
    "model_slug", "open_bucket", "parse_duration", "parse_size", "plan_log_purge", "plan_purge", "prewarm_disk",
    "prewarm_host", "prewarm_manager", "rank_hottest", "summarize", "with_access",
]


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


async def open_bucket(cfg: Config) -> Any:
    """A started :class:`S3Tier` for ``cfg`` that never creates a bucket.

    An explicit ``s3.endpoint`` is used as is; an empty one means the embedded SeaweedFS (started or
    reused) when ``embedded_s3.enabled``, else AWS S3. Raises ConfigError (credentials, missing bucket)
    or TierUnavailableError (unreachable endpoint)."""
    import msgspec

    from kvbm.tiers.s3 import make_s3_tier

    if not cfg.s3.enabled:
        raise ConfigError("the S3 tier is disabled (s3.enabled: false)")
    s3cfg = msgspec.structs.replace(cfg.s3, create_bucket=False, scan_on_start=False)
    endpoint = cfg.s3.endpoint or None
    creds = None
    if endpoint is None and cfg.embedded_s3.enabled:
        from kvbm.stack import start_embedded_s3

        emb = await asyncio.to_thread(start_embedded_s3, cfg)
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
                if foreign is not None and not is_access_key(tier.prefix, okey):  # access logs are kvbm's own
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


# -- recency ---------------------------------------------------------------------------------------------
def with_access(entries: Iterable[Entry], times: dict[BlockKey, float]) -> list[Entry]:
    """``entries`` with ``accessed`` set from merged access logs (:func:`kvbm.recency.read_access_times`)."""
    return [dataclasses.replace(e, accessed=times[e.key]) if e.key in times else e for e in entries]


def plan_log_purge(logs: Iterable[AccessLog], sel: Selector, keep_s: float,
                   now: float | None = None) -> list[AccessLog]:
    """Access logs to delete: those of in-scope namespaces written more than ``keep_s`` ago, and with
    ``--all`` (no key prefix) every log of the namespaces being emptied."""
    now = time.time() if now is None else now
    every = sel.all and not sel.prefix
    return [lg for lg in logs if sel.ns_in_scope(lg.namespace) and (every or now - lg.epoch > keep_s)]


# -- purge -----------------------------------------------------------------------------------------------
def plan_purge(entries: Iterable[Entry], sel: Selector, now: float | None = None) -> list[Entry]:
    """What to delete, least recently used first: every in-scope entry when ``sel.all`` or when only a
    prefix was given; else those not used (written or, per the access logs, read) for ``sel.older_than_s``;
    then, with ``sel.max_bytes``, the least recently used of what is left in each (store, namespace) until
    it is at most ``max_bytes``. Entries without a recorded access go by their write time."""
    if not sel.has_criterion:
        raise ConfigError("no purge criterion: give --older-than, --max-bytes, --prefix or --all")
    now = time.time() if now is None else now
    scoped = [e for e in entries if sel.in_scope(e)]
    take_all = sel.all or (sel.prefix and sel.older_than_s is None and sel.max_bytes is None)
    chosen: dict[tuple[str, str], Entry] = {}
    keep: list[Entry] = []
    for e in scoped:
        if take_all or (sel.older_than_s is not None and now - e.last_used > sel.older_than_s):
            chosen[(e.store, e.ref)] = e
        else:
            keep.append(e)
    if sel.max_bytes is not None:
        groups: dict[tuple[str, str], list[Entry]] = {}
        for e in keep:
            groups.setdefault((e.store, e.namespace), []).append(e)
        for group in groups.values():
            total = sum(e.size for e in group)
            for e in sorted(group, key=lambda e: (e.last_used, e.accessed, e.ref)):
                if total <= sel.max_bytes:
                    break
                chosen[(e.store, e.ref)] = e
                total -= e.size
    return sorted(chosen.values(), key=lambda e: (e.last_used, e.accessed, e.store, e.ref))


@dataclass
class DeleteResult:
    deleted: int = 0
    bytes: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)  # (ref, reason)
    done: list[Entry] = field(default_factory=list)
    interrupted: str = ""  # why the run stopped early ("" when it finished)

    def merge(self, other: DeleteResult) -> None:
        self.deleted += other.deleted
        self.bytes += other.bytes
        self.errors += other.errors
        self.done += other.done
        self.interrupted = self.interrupted or other.interrupted


async def delete_bucket(tier: Any, entries: Sequence[Entry], progress: Callable[[int], None] | None = None,
                        batch: int | None = None, into: DeleteResult | None = None) -> DeleteResult:
    """Delete ``entries`` (bucket ones) in batches; a key is re-checked against the key scheme first.
    A batch that raises stops the run (``interrupted``); what was deleted before stays deleted. Progress
    is recorded in ``into`` as it happens, so it survives a KeyboardInterrupt."""
    res = DeleteResult() if into is None else into
    todo = [e for e in entries if e.store == "bucket"]
    size = batch or DELETE_BATCH
    for i in range(0, len(todo), size):
        chunk = todo[i : i + size]
        safe = []
        for e in chunk:
            if tier.parse_key(e.ref) == e.key and tier.object_key(e.key) == e.ref:
                safe.append(e)
            else:  # never reached for entries from iter_bucket; a guard against misuse
                res.errors.append((e.ref, "not a kvbm block key; refused"))
        try:
            _deleted, errors = await tier.delete_many([e.ref for e in safe])
        except Exception as e:
            res.interrupted = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            break
        failed = {k: f"{code} {msg}".strip() for k, code, msg in errors}
        for e in safe:
            if e.ref in failed:
                res.errors.append((e.ref, failed[e.ref]))
            else:
                res.deleted += 1
                res.bytes += e.size
                res.done.append(e)
        if progress:
            progress(len(chunk))
    return res


def delete_disk(root: str | os.PathLike[str], entries: Sequence[Entry],
                progress: Callable[[int], None] | None = None, into: DeleteResult | None = None) -> DeleteResult:
    """Unlink block files (only regular files under ``root`` named like kvbm blocks; a file already gone
    counts as deleted). Empty directories are left alone (a writer may be about to use them)."""
    res = DeleteResult() if into is None else into
    rootp = os.path.realpath(root)
    todo = [e for e in entries if e.store == "disk"]
    for i in range(0, len(todo), DELETE_BATCH):
        chunk = todo[i : i + DELETE_BATCH]
        for e in chunk:
            expect = os.path.join(rootp, e.namespace, e.key.hex[:2], e.key.hex + DISK_SUFFIX)
            parent = os.path.realpath(os.path.dirname(e.ref))
            if os.path.join(parent, os.path.basename(e.ref)) != expect:
                res.errors.append((e.ref, "not a kvbm block file under the disk dir; refused"))
                continue
            try:
                if os.path.islink(e.ref):
                    res.errors.append((e.ref, "symlink; refused"))
                    continue
                os.unlink(e.ref)
            except FileNotFoundError:
                pass
            except OSError as err:
                res.errors.append((e.ref, err.strerror or str(err)))
                continue
            res.deleted += 1
            res.bytes += e.size
            res.done.append(e)
        if progress:
            progress(len(chunk))
    return res


# -- daemon ----------------------------------------------------------------------------------------------
def daemon_reachable(endpoint: str, timeout_s: float = 0.3) -> tuple[bool, str]:
    """A cheap pre-check before a ZeroMQ round trip: is anything listening at ``endpoint``?"""
    if endpoint.startswith("tcp://"):
        hostport = endpoint[len("tcp://") :]
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]")
        if host in ("*", "0.0.0.0", ""):
            host = "127.0.0.1"
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True, ""
        except ValueError:
            return False, f"bad daemon endpoint {endpoint!r}"
        except OSError as e:
            return False, f"nothing listens at {endpoint} ({e.strerror or type(e).__name__})"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path.startswith("@") or os.path.exists(path):
            return True, ""
        return False, f"no daemon socket at {path}"
    if "://" not in endpoint:
        return False, f"bad daemon endpoint {endpoint!r} (e.g. tcp://127.0.0.1:5557 or ipc:///run/kvbm.sock)"
    return True, ""


class DaemonLink:
    """A registration-only session with the daemon (every request but Register needs a worker token).

    It registers a 1-byte dummy layout and never maps the daemon's shared memory; :meth:`close`
    unregisters, so the daemon's worker count drops back."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0, curve_server_key: str = "", *,
                 curve_keypair: tuple[bytes, bytes] | None = None, admin_token: str = "") -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve_server_key = curve_server_key
        self.curve_keypair = curve_keypair
        self.admin_token = admin_token
        self.client: Any = None
        self.registered: Any = None

    @classmethod
    def for_config(cls, cfg: Config, endpoint: str, timeout_s: float = 2.0) -> DaemonLink:
        """A link with the config's CURVE client keys and, when readable, its admin token."""
        from kvbm.client import client_options

        return cls(endpoint, timeout_s, **client_options(cfg.daemon, admin=True))

    @property
    def admin(self) -> bool:
        return bool(self.admin_token)

    def open(self) -> DaemonLink:
        from kvbm import protocol as p
        from kvbm.client import WorkerClient
        from kvbm.layout import KVLayout

        layout = KVLayout(model="kvbm-cli", num_layers=1, num_kv_heads=1, head_size=1, dtype="uint8", kv_factor=1,
                          tokens_per_block=1, block_bytes=1)
        self.client = WorkerClient(self.endpoint, timeout_s=self.timeout_s, curve_server_key=self.curve_server_key,
                                   curve_keypair=self.curve_keypair, admin_token=self.admin_token)
        try:
            reg = self.client.request(p.Register(worker_id=f"kvbm-cli-{os.getpid()}-{secrets.token_hex(3)}",
                                                 engine_id="kvbm-cli", layout=layout, admin_token=self.admin_token),
                                      p.Registered)
        except BaseException:
            self.client._reset()
            self.client = None
            raise
        self.client.token = reg.token
        self.client.generation = reg.generation  # its Onboard/Release name slots of this pool generation
        self.registered = reg
        return self

    def stats(self) -> dict[str, Any]:
        return self.client.stats()  # type: ignore[no-any-return]

    def tiers(self) -> list[str]:
        return [t.get("tier", "") for t in self.stats().get("tiers", [])]

    def evict(self, namespace: str, hashes: Sequence[bytes], tiers: list[str] | None,
              chunk: int = 8192, timeout_s: float = 60.0) -> tuple[int, int]:
        """Evict ``hashes`` of ``namespace`` from ``tiers``; returns (removed, skipped as pinned)."""
        from kvbm import protocol as p

        removed = skipped = 0
        for i in range(0, len(hashes), chunk):
            rep = self.client.request(p.Evict(namespace=namespace, hashes=list(hashes[i : i + chunk]), tiers=tiers),
                                      p.Evicted, timeout_s)
            removed += rep.removed
            skipped += rep.skipped
        return removed, skipped

    def reindex(self, namespace: str, tiers: list[str] | None, timeout_s: float = 120.0) -> int:
        """Have the daemon re-read ``tiers`` for ``namespace``; returns the blocks it did not know before."""
        from kvbm import protocol as p

        return int(self.client.request(p.Reindex(namespace=namespace, tiers=tiers), p.Reindexed, timeout_s).added)

    def onboard(self, namespace: str, hashes: Sequence[bytes], timeout_s: float = 120.0) -> tuple[int, int]:
        """Onboard the leading held run of ``hashes`` into the daemon's host tier and release the pins at
        once (the blocks stay cached there); returns (leading blocks onboarded, their bytes)."""
        from kvbm import protocol as p

        rep = self.client.request(p.Onboard(namespace=namespace, hashes=list(hashes)), p.Onboarded, timeout_s)
        if rep.count:
            self.client.request(p.Release(namespace=namespace, hashes=list(hashes[: rep.count])), p.Released)
        return int(rep.count), int(sum(rep.nbytes))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def __enter__(self) -> DaemonLink:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- prewarm ---------------------------------------------------------------------------------------------
def keys_from_hashes_file(path: str, namespace: str) -> list[BlockKey]:
    """One hex block hash per line (blank lines and ``#`` comments skipped)."""
    check_namespace(namespace)
    out: list[BlockKey] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            s = line.split("#", 1)[0].strip().lower()
            if not s:
                continue
            if s.startswith("0x"):
                s = s[2:]
            if not is_hash_hex(s):
                raise ConfigError(f"{path}:{n}: {line.strip()[:40]!r} is not a hex block hash")
            out.append(BlockKey(namespace, bytes.fromhex(s)))
    return list(dict.fromkeys(out))


def keys_from_tokens_file(path: str, namespace: str, block_tokens: int, scheme: str = "kvbm",
                          vllm_block_size: int | None = None, salt: str | None = None,
                          lora: str | None = None) -> list[list[BlockKey]]:
    """One JSON list of token ids per line -> the chained block keys of each prompt (full blocks only)."""
    from kvbm.hashing import prefix_hashes

    check_namespace(namespace)
    if block_tokens <= 0:
        raise ConfigError("--block-tokens must be positive")
    chains: list[list[BlockKey]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                toks = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise ConfigError(f"{path}:{n}: expected a JSON list of token ids (ints)")
            try:
                hashes = prefix_hashes(toks, block_tokens, scheme=scheme, vllm_block_size=vllm_block_size,
                                       salt=salt, lora=lora)
            except ValueError as e:
                raise ConfigError(f"{path}:{n}: {e}") from None
            chains.append([BlockKey(namespace, h) for h in hashes])
    return chains


@dataclass
class PrewarmReport:
    requested: int = 0
    present: int = 0  # already in the target tier
    fetched: int = 0
    bytes: int = 0
    seconds: float = 0.0
    missing: list[BlockKey] = field(default_factory=list)  # not in the bucket (or the daemon's index)
    unreachable: int = 0  # after a missing block of a prompt (a prefix lookup can never reach them)
    failed: list[tuple[str, str]] = field(default_factory=list)
    no_room: int = 0  # skipped: the disk tier's capacity would be exceeded

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested, "already_present": self.present, "fetched": self.fetched,
            "bytes": self.bytes, "seconds": round(self.seconds, 3), "bytes_per_s": round(self.rate, 1),
            "missing": len(self.missing), "missing_keys": [str(k) for k in self.missing[:1000]],
            "unreachable_after_gap": self.unreachable, "failed": len(self.failed),
            "failures": [{"key": k, "error": e} for k, e in self.failed[:100]], "skipped_no_room": self.no_room,
        }


def rank_hottest(entries: Iterable[Entry], hottest: int | None = None, max_bytes: int | None = None) -> list[Entry]:
    """Most recently used first (last recorded access, else write time): the first ``hottest`` entries and/or
    as many as fit in ``max_bytes`` of object size."""
    ranked = sorted(entries, key=lambda e: (-e.last_used, -e.accessed, e.ref))
    if hottest is not None:
        ranked = ranked[: max(0, hottest)]
    if max_bytes is not None:
        out, total = [], 0
        for e in ranked:
            if total + e.size > max_bytes:
                break
            out.append(e)
            total += e.size
        ranked = out
    return ranked


async def prewarm_manager(manager: Any, tier: Any, namespaces: Sequence[str], hottest: int, to: str,
                          concurrency: int = 8) -> dict[str, Any]:
    """A daemon joining warm: bring the ``hottest`` most recently used blocks (fleet-wide, see
    :mod:`kvbm.recency`) of each namespace (default: every namespace with access logs) from the bucket
    ``tier`` into the manager's tier ``to``. The onboards count as hits, like any other use."""
    from kvbm.recency import list_logs, read_access_times

    nss = list(namespaces) or sorted({lg.namespace for lg in await list_logs(tier)})
    sem = asyncio.Semaphore(max(1, concurrency))
    out = {"namespaces": len(nss), "requested": 0, "prewarmed": 0}

    async def one(key: BlockKey) -> None:
        async with sem:
            out["prewarmed"] += await manager.onboard([key], to=to)

    for ns in nss:
        await manager.index_tier(tier.name, ns)  # the manager must know what the bucket holds
        entries = [e async for e in iter_bucket(tier, Selector(namespaces=(ns,), shard_chars=tier.shard_chars))]
        times, _logs = await read_access_times(tier, [ns])
        ranked = rank_hottest(with_access(entries, times), hottest)
        out["requested"] += len(ranked)
        await asyncio.gather(*(one(e.key) for e in ranked))
    return out


def leading_runs(chains: Sequence[Sequence[BlockKey]], available: set[BlockKey],
                 report: PrewarmReport) -> list[BlockKey]:
    """For prompt chains: the blocks up to each prompt's first unavailable one (deduplicated, in order);
    records the first missing block of each prompt and counts the blocks after it."""
    out: dict[BlockKey, None] = {}
    missing: dict[BlockKey, None] = {}
    for chain in chains:
        for i, k in enumerate(chain):
            if k not in available:
                missing[k] = None
                report.unreachable += len(chain) - i - 1
                break
            out[k] = None
    report.missing = list(missing)
    return list(out)


async def prewarm_disk(cfg: Config, tier: Any, wanted: Sequence[tuple[BlockKey, int]], report: PrewarmReport,
                       concurrency: int = 8, progress: Callable[[int, int], None] | None = None) -> PrewarmReport:
    """Copy ``(key, object size)`` pairs from the bucket ``tier`` into the disk tier of ``cfg``, at most
    ``concurrency`` at a time, skipping blocks whose file already exists and stopping at the disk
    capacity. The disk tier is not started (no re-index, no temp-file sweep), so this is safe next to a
    running daemon that uses the same directory."""
    from kvbm.tiers.disk import DiskTier
    from kvbm.tiers.s3 import HEADER_LEN
    from kvbm.transfer import make_file_io

    cap = parse_size(cfg.disk.capacity, "disk.capacity")
    disk = DiskTier(cfg.disk_dir, cap, make_file_io(cfg.transfer), fsync=cfg.disk.fsync,
                    o_direct=cfg.disk.o_direct, io_threads=max(1, min(concurrency, 16)))
    used = sum(e.size for e in iter_disk(cfg.disk_dir))
    todo: list[tuple[BlockKey, int]] = []
    for k, size in wanted:
        if disk.path_for(k).exists():
            report.present += 1
            if progress:
                progress(1, 0)
            continue
        fp = disk.footprint(max(0, size - HEADER_LEN))
        if used + fp > cap:
            report.no_room += 1
            if progress:
                progress(1, 0)
            continue
        used += fp
        todo.append((k, size))
    sem = asyncio.Semaphore(max(1, concurrency))
    t0 = time.perf_counter()

    async def one(k: BlockKey, size: int) -> None:
        async with sem:
            buf = bytearray(max(0, size - HEADER_LEN))
            try:
                n = await tier.get_into(k, memoryview(buf))
                if n is None:
                    report.missing.append(k)
                else:
                    await disk.put(k, memoryview(buf)[:n])
                    report.fetched += 1
                    report.bytes += n
            except (KvbmError, OSError, ValueError) as e:
                report.failed.append((str(k), " ".join(str(e).split())[:200] or type(e).__name__))
            if progress:
                progress(1, report.bytes)

    try:
        await asyncio.gather(*(one(k, s) for k, s in todo))
    finally:
        report.seconds = time.perf_counter() - t0
        await disk.close()
    return report


def prewarm_host(link: DaemonLink, groups: Sequence[Sequence[BlockKey]], report: PrewarmReport, *,
                 chains: bool = False, batch: int = 64,
                 progress: Callable[[int, int], None] | None = None) -> PrewarmReport:
    """Have the daemon onboard each group into its host tier. Onboard brings up a group's leading held
    run; the first block it could not bring is recorded as missing. For independent keys the rest of the
    group is tried after it; for prompt ``chains`` the rest is unreachable by a prefix lookup and skipped."""
    t0 = time.perf_counter()
    reg = link.registered
    if reg is not None and reg.num_slots:
        batch = max(1, min(batch, reg.num_slots // 2 or 1))
    for group in groups:
        i = 0
        while i < len(group):
            chunk = group[i : i + batch]
            ns = chunk[0].namespace
            try:
                n, nbytes = link.onboard(ns, [k.hash for k in chunk])
            except KvbmError as e:
                report.failed.extend((str(k), str(e)[:200]) for k in chunk)
                i += len(chunk)
                if progress:
                    progress(len(chunk), report.bytes)
                continue
            report.fetched += n
            report.bytes += nbytes
            if n < len(chunk):
                report.missing.append(chunk[n])
                if chains:
                    report.unreachable += len(group) - (i + n) - 1
                    if progress:
                        progress(len(group) - i, report.bytes)
                    break
                n += 1
            i += n
            if progress:
                progress(n, report.bytes)
    report.seconds = time.perf_counter() - t0
    return report
