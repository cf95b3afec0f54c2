"""Purge: what to delete (:func:`plan_purge`, :func:`plan_log_purge`) and deleting it safely.

Deletion is batched (``DELETE_BATCH`` keys per DeleteObjects request), idempotent (a key already gone is
not an error) and re-checked against the key scheme just before each request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbm.blocks.keys import DISK_SUFFIX
from kvbm.errors import ConfigError
from kvbm.fleet.recency import AccessLog
from kvbm.ops.inventory import Entry, Selector

DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)


def plan_log_purge(logs: Iterable[AccessLog], sel: Selector, keep_s: float,
                   now: float | None = None) -> list[AccessLog]:
    """Access logs to delete: those of in-scope namespaces written more than ``keep_s`` ago, and with
    ``--all`` (no key prefix) every log of the namespaces being emptied."""
    now = time.time() if now is None else now
    every = sel.all and not sel.prefix
    return [lg for lg in logs if sel.ns_in_scope(lg.namespace) and (every or now - lg.epoch > keep_s)]


def value_order(now: float, age0_s: float | None = None) -> Any:
    """Sort key of ``--by value``: the placement policy's hit density (kvbm.manager.placement), lowest first. What
    the bucket tells of a block is whether any node hit it since it was written (the access logs) and when it was
    last used: a block hit since written is in the policy's second class, a one-off in its first."""
    from kvbm.manager.placement import DEFAULT_AGE0_S, DEFAULT_WEIGHTS

    a0 = DEFAULT_AGE0_S if age0_s is None else age0_s

    def key(e: Entry) -> tuple[float, float, str]:
        cls = 1 if e.accessed > e.mtime else 0
        return (DEFAULT_WEIGHTS[cls] / (max(0.0, now - e.last_used) + a0), e.last_used, e.ref)

    return key


def plan_purge(entries: Iterable[Entry], sel: Selector, now: float | None = None, *,
               rank: str = "access") -> list[Entry]:
    """What to delete, least recently used first: every in-scope entry when ``sel.all`` or when only a
    prefix was given; else those not used (written or, per the access logs, read) for ``sel.older_than_s``;
    then, with ``sel.max_bytes``, the least recently used of what is left in each (store, namespace) until
    it is at most ``max_bytes`` (``rank="value"``: the blocks the placement policy values least first,
    :func:`value_order`). Entries without a recorded access go by their write time."""
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
            order = value_order(now) if rank == "value" else (lambda e: (e.last_used, e.accessed, e.ref))
            for e in sorted(group, key=order):
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

    def record(self, e: Entry) -> None:
        """Count ``e`` as deleted."""
        self.deleted += 1
        self.bytes += e.size
        self.done.append(e)

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
                res.record(e)
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
            res.record(e)
        if progress:
            progress(len(chunk))
    return res
