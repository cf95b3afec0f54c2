"""One ``kvbm purge`` run, start to end, for the CLI, a cron job or another program: :func:`run_purge`.

List what is in scope (disk and/or bucket), rank it by the fleet's access logs, plan (:mod:`kvbm.ops.purge`), ask,
delete under the disk directory's lock, and tell a running daemon what went so its index stays true. What the
caller sees and answers goes through a :class:`PurgeUI` (text lines, the confirmation, a progress count)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvbm.config import Config
from kvbm.config.schema import human_bytes
from kvbm.errors import KvbmError
from kvbm.fleet.recency import AccessLog, read_access_times
from kvbm.ops.inventory import Entry, Selector, iter_bucket, iter_disk, open_bucket, with_access
from kvbm.ops.link import DaemonLink, daemon_reachable
from kvbm.ops.purge import DeleteResult, delete_bucket, delete_disk, plan_log_purge, plan_purge
from kvbm.security import admin_token_path
from kvbm.tiers.dirlock import DirLock, DiskDirBusy


class PurgeUsageError(KvbmError):
    """The options select nothing, or contradict each other (the CLI's usage error)."""


class PurgeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What to purge (as ``kvbm purge``'s options; see its help) and how to reach the daemon."""

    namespaces: tuple[str, ...] = ()
    model: str | None = None
    prefix: str | None = None  # relative to s3.prefix, or a full object key under it
    older_than_s: float | None = None
    all: bool = False
    max_bytes: int | None = None
    by: str = "access"  # access, written or value
    log_keep_s: float = 30 * 86400.0
    source: str = "both"  # bucket, disk or both
    dry_run: bool = False
    yes: bool = False  # no confirmation asked
    daemon_endpoint: str | None = None  # named: it must answer before anything is deleted
    direct: bool = False
    daemon_timeout_s: float = 2.0


def _quiet(_line: str) -> None:
    pass


@contextlib.contextmanager
def _no_progress(_total: int) -> Iterator[Callable[[int], None]]:
    yield lambda _n: None


def _refuse(blocks: int, nbytes: int, logs: int) -> bool:
    return False


@dataclass
class PurgeUI:
    """The caller's side: ``say`` a line; ``confirm(blocks, bytes, access_logs)`` before deleting (False: abort);
    ``progress(total)`` a context giving an ``advance(n)`` callable. The defaults print nothing and never delete
    without ``PurgeOptions.yes``."""

    say: Callable[[str], None] = _quiet
    confirm: Callable[[int, int, int], bool] = _refuse
    progress: Callable[[int], Any] = _no_progress


class PurgeAborted(KvbmError):
    """The confirmation was declined."""


def find_link(cfg: Config, endpoint: str | None, direct: bool, timeout_s: float) -> tuple[DaemonLink | None, str]:
    """A registered link to the daemon, or (None, why not). An explicit ``endpoint`` that does not answer raises
    KvbmError; the configured default falls back quietly."""
    if direct:  # wins over --daemon / $KVBM_DAEMON
        return None, "--direct"
    ep = endpoint or cfg.daemon.endpoint
    ok, why = daemon_reachable(ep)
    if ok:
        try:
            return DaemonLink.for_config(cfg, ep, timeout_s).open(), ""
        except KvbmError as e:
            why = f"daemon at {ep} did not answer: {' '.join(str(e).split())[:200]}"
    elif not why.startswith("bad"):
        why = f"no daemon at {ep}: {why}"
    if endpoint:
        raise KvbmError(why)
    return None, why


def _plan_lines(plan: list[Entry]) -> list[str]:
    groups: dict[tuple[str, str], list[int]] = {}
    for e in plan:
        g = groups.setdefault((e.store, e.namespace), [0, 0])
        g[0] += 1
        g[1] += e.size
    return [f"  {store:<6} {ns}: {n} blocks, {human_bytes(b)}" for (store, ns), (n, b) in sorted(groups.items())]


def _selector(cfg: Config, o: PurgeOptions) -> Selector:
    if o.namespaces and o.model:
        raise PurgeUsageError("give --namespace or --model, not both")
    prefix, base = o.prefix, cfg.s3.prefix.strip("/")
    if prefix and base and prefix.lstrip("/").startswith(base + "/"):
        prefix = prefix.lstrip("/")[len(base) + 1 :]  # a full object key was given: make it relative
    sel = Selector(namespaces=o.namespaces, model=o.model, prefix=prefix, older_than_s=o.older_than_s, all=o.all,
                   max_bytes=o.max_bytes, shard_chars=cfg.s3.shard_chars)
    if not sel.has_criterion:
        what = "--namespace/--model only narrow the scope; " if (o.namespaces or o.model) else ""
        raise PurgeUsageError(f"nothing selected: {what}give --older-than, --max-bytes, --prefix or --all")
    return sel


@dataclass
class _Run:
    """The state of one run: its event loop, the bucket tier once opened, what is in scope and planned."""

    cfg: Config
    o: PurgeOptions
    ui: PurgeUI
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    tier: Any = None
    use_disk: bool = False
    use_bucket: bool = False

    def open_bucket(self) -> Any:
        if self.tier is None:
            self.tier = self.loop.run_until_complete(open_bucket(self.cfg))
        return self.tier

    def entries(self, sel: Selector) -> list[Entry]:
        out: list[Entry] = list(iter_disk(self.cfg.disk_dir, sel)) if self.use_disk else []
        if self.use_bucket:
            tier = self.open_bucket()

            async def listing() -> list[Entry]:
                return [e async for e in iter_bucket(tier, sel)]

            out += self.loop.run_until_complete(listing())
        return out

    def rank(self, entries: list[Entry], sel: Selector) -> tuple[list[Entry], list[AccessLog], str]:
        """Entries with the fleet's last hits (the bucket's access logs), those logs, and what ranks them."""
        cfg = self.cfg
        # A disk-only purge reads the logs of a configured bucket, but never starts the embedded SeaweedFS for it.
        if not (self.o.by in ("access", "value") and entries and cfg.s3.enabled
                and (self.use_bucket or cfg.s3.endpoint)):
            return entries, [], "write time"
        try:
            times, logs = self.loop.run_until_complete(read_access_times(self.open_bucket(), sel.namespaces or None))
        except KvbmError as e:
            if self.use_bucket:
                raise
            return entries, [], f"write time (bucket access logs unreadable: {' '.join(str(e).split())[:200]})"
        recency = f"access ({len(logs)} access logs, {len(times)} blocks with a recorded hit)"
        return with_access(entries, times), logs, recency

    def delete(self, plan: list[Entry], log_plan: list[AccessLog]) -> tuple[DeleteResult, int, float]:
        """Delete ``plan`` (disk, then bucket) and the old access logs: the result, logs deleted, seconds."""
        guard = disk_guard(self.cfg, self.use_disk, self.o.daemon_endpoint, self.o.direct, self.o.daemon_timeout_s)
        res = DeleteResult()
        logs_deleted = 0
        t0 = time.perf_counter()
        try:
            with self.ui.progress(len(plan)) as advance:
                if self.use_disk:
                    delete_disk(self.cfg.disk_dir, plan, advance, into=res)
                if self.tier is not None and not res.interrupted:
                    self.loop.run_until_complete(delete_bucket(self.tier, plan, advance, into=res))
                if log_plan and not res.interrupted:
                    logs_deleted, log_errors = self.loop.run_until_complete(
                        self.tier.delete_many([lg.key for lg in log_plan]))
                    res.errors += [(k, f"{code} {msg}".strip()) for k, code, msg in log_errors]
        except KeyboardInterrupt:
            res.interrupted = "interrupted (Ctrl-C)"
        finally:
            guard.release()
        return res, logs_deleted, time.perf_counter() - t0

    def close(self) -> None:
        loop = self.loop
        pending = asyncio.all_tasks(loop)
        for task in pending:  # e.g. a DeleteObjects request cut short by Ctrl-C
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        if self.tier is not None:
            loop.run_until_complete(self.tier.close())
        loop.close()


def run_purge(cfg: Config, o: PurgeOptions, ui: PurgeUI | None = None) -> dict[str, Any]:
    """Purge what ``o`` selects; returns the summary (``kvbm purge --json``'s object: ``selected``, ``deleted``,
    ``errors``, ``interrupted``, ...). Raises PurgeUsageError for options that select nothing, PurgeAborted when
    the confirmation is declined, KvbmError when a store cannot be read. A partly failed deletion is in the summary
    (``interrupted``, ``errors``), not raised: the caller says what went first."""
    ui = ui or PurgeUI()
    sel = _selector(cfg, o)
    run = _Run(cfg, o, ui)
    run.use_disk = o.source in ("disk", "both") and cfg.disk.enabled
    run.use_bucket = o.source in ("bucket", "both") and cfg.s3.enabled
    if o.source == "bucket" and not cfg.s3.enabled:
        raise KvbmError("--from bucket, but the S3 tier is disabled in this config")
    if o.source == "disk" and not cfg.disk.enabled:
        raise KvbmError("--from disk, but the disk tier is disabled in this config")
    if o.daemon_endpoint and not o.dry_run:  # named explicitly: it must answer before anything is deleted
        link, _why = find_link(cfg, o.daemon_endpoint, o.direct, o.daemon_timeout_s)
        if link is not None:
            link.close()
    try:
        entries, logs, recency = run.rank(run.entries(sel), sel)
        plan = plan_purge(entries, sel, rank="value" if o.by == "value" else "access")
        log_plan = plan_log_purge(logs, sel, o.log_keep_s) if run.use_bucket else []
        total = sum(e.size for e in plan)
        where = " and ".join(w for w, on in (("bucket", run.use_bucket), ("disk", run.use_disk)) if on) or "nothing"
        ui.say(f"{'would delete' if o.dry_run else 'to delete'}: {len(plan)} blocks, {human_bytes(total)} "
               f"(of {len(entries)} in scope, from {where}; by {recency})")
        for line in _plan_lines(plan):
            ui.say(line)
        if log_plan:
            ui.say(f"  access logs: {len(log_plan)} old ones")
        summary: dict[str, Any] = {"dry_run": o.dry_run, "selected": len(plan), "selected_bytes": total,
                                   "in_scope": len(entries), "deleted": 0, "bytes_freed": 0, "errors": 0,
                                   "by": ("value" if o.by == "value" else "access") if recency.startswith("access")
                                   else "written",
                                   "access_logs": len(logs), "access_logs_selected": len(log_plan),
                                   "access_logs_deleted": 0}
        if o.dry_run or not (plan or log_plan):
            if not plan:
                ui.say("nothing to delete")
            return summary
        if not o.yes and not ui.confirm(len(plan), total, len(log_plan)):
            raise PurgeAborted("purge not confirmed: nothing deleted")
        res, logs_deleted, seconds = run.delete(plan, log_plan)
        t1 = time.perf_counter()
        notice = tell_daemon(cfg, res.done, run.use_disk, run.use_bucket, o.daemon_endpoint, o.direct,
                             o.daemon_timeout_s)
        summary.update(daemon_seconds=round(time.perf_counter() - t1, 3))
        summary.update(deleted=res.deleted, bytes_freed=res.bytes, errors=len(res.errors), seconds=round(seconds, 3),
                       keys_per_s=round(res.deleted / seconds, 1) if seconds > 0 else None,
                       interrupted=res.interrupted or None, daemon=notice, access_logs_deleted=logs_deleted,
                       error_samples=[{"key": k, "error": m} for k, m in res.errors[:20]])
        return summary
    finally:
        run.close()


def disk_guard(cfg: Config, use_disk: bool, endpoint: str | None, direct: bool, timeout_s: float) -> DirLock:
    """A shared lock on the disk directory for a direct delete; refused while a daemon owns the directory
    unless that daemon answers (it is told what went, so its index stays true)."""
    guard = DirLock(cfg.disk_dir)
    if not use_disk:
        return guard
    try:
        return guard.acquire(shared=True)
    except DiskDirBusy as e:
        link, _why = (None, "--direct") if direct else find_link(cfg, endpoint, direct, timeout_s)
        if link is None:
            raise KvbmError(
                f"{e}: a kvbm daemon owns it, and deleting its files with --direct would leave its index "
                "wrong; purge through the daemon (without --direct) or stop it first") from None
        admin = link.admin
        link.close()
        if not admin:  # the daemon would refuse the Evict that keeps its index true: delete nothing
            raise KvbmError(
                f"{e}: a kvbm daemon owns it and purging its files needs its admin token, which this user cannot "
                f"read (daemon.admin_token_file: {admin_token_path(cfg.daemon)})") from None
        return guard


def tell_daemon(cfg: Config, done: list[Entry], disk: bool, bucket: bool, endpoint: str | None, direct: bool,
                timeout_s: float) -> str:
    """Best effort: ask a running daemon to drop the deleted blocks from its index (G3/G4 only)."""
    if not done:
        return "nothing to tell"
    try:
        link, why = find_link(cfg, endpoint, direct, timeout_s)
    except KvbmError as e:
        return f"not told ({e})"
    if link is None:
        return f"not told ({why})" if why != "--direct" else "not told (--direct)"
    try:
        kinds = {"disk": disk, "s3": bucket}
        tiers = [t["tier"] for t in link.stats().get("tiers", []) if kinds.get(t.get("kind"))]
        if not tiers:
            return "told nothing (the daemon has no disk/S3 tier)"
        by_ns: dict[str, dict[bytes, None]] = {}
        for e in done:
            by_ns.setdefault(e.namespace, {})[e.key.hash] = None
        removed = skipped = 0
        for ns, hashes in by_ns.items():
            r, s = link.evict(ns, list(hashes), tiers, gone=True)  # deleted above: the daemon only forgets them
            removed += r
            skipped += s
        return f"{link.endpoint} dropped {removed} index entries from {','.join(tiers)}" + (
            f" ({skipped} pinned, left)" if skipped else "")
    except KvbmError as e:
        return f"not told ({' '.join(str(e).split())[:200]})"
    finally:
        link.close()
