"""``kvbm purge``: delete cached blocks from the bucket and/or the disk tier, safely."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import click

from kvbm.cli.common import (
    SIZE,
    CliState,
    config_option,
    daemon_options,
    find_daemon,
    human_bytes,
    one_line_errors,
    pass_state,
)
from kvbm.errors import ConfigError, KvbmError
from kvbm.fleet.recency import AccessLog, read_access_times
from kvbm.ops import (
    DeleteResult,
    Entry,
    Selector,
    delete_bucket,
    delete_disk,
    iter_bucket,
    iter_disk,
    open_bucket,
    parse_duration,
    plan_log_purge,
    plan_purge,
    with_access,
)
from kvbm.security import admin_token_path
from kvbm.tiers.dirlock import DirLock, DiskDirBusy


def _duration(_ctx: Any, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ConfigError as e:
        raise click.BadParameter(str(e), param=param) from None


def _plan_lines(plan: list[Entry]) -> list[str]:
    groups: dict[tuple[str, str], list[int]] = {}
    for e in plan:
        g = groups.setdefault((e.store, e.namespace), [0, 0])
        g[0] += 1
        g[1] += e.size
    return [f"  {store:<6} {ns}: {n} blocks, {human_bytes(b)}" for (store, ns), (n, b) in sorted(groups.items())]


@click.command("purge")
@config_option
@click.option("--older-than", "older_than", metavar="AGE", callback=_duration,
              help="Blocks last written more than AGE ago (s/m/h/d/w, e.g. 7d, 12h, 1d12h).")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Only this layout namespace (<model-slug>-<16 hex>); repeatable.")
@click.option("--model", metavar="SLUG", help="Only namespaces of this model (e.g. meta-llama/Llama-3.1-8B).")
@click.option("--prefix", metavar="KEY", help="Blocks whose key starts with KEY, relative to kvbm's prefix: "
              "<namespace>/<shard>/<hash> (e.g. 'llama-3-8b-0123456789abcdef/ab').")
@click.option("--all", "all_", is_flag=True,
              help="Every block in scope (of --namespace/--model, or of every namespace).")
@click.option("--max-bytes", metavar="SIZE", type=SIZE,
              help="Keep each namespace at most SIZE (e.g. 10GiB) per store, deleting its least recently used "
                   "blocks first.")
@click.option("--by", "by", type=click.Choice(["access", "written", "value"]), default="access", show_default=True,
              help="Age and rank blocks by their last use anywhere in the fleet (the bucket's access logs; "
                   "write time where none is recorded), or by write time only; value: as access, but --max-bytes "
                   "keeps what the placement policy values most (blocks hit since written before one-offs).")
@click.option("--access-log-retention", "log_keep", metavar="AGE", callback=_duration, default="30d",
              show_default=True, help="Delete access logs older than AGE (their hits no longer protect a block).")
@click.option("--from", "from_", type=click.Choice(["bucket", "disk", "both"]), default="both", show_default=True,
              help="Which store to purge.")
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted (count and bytes).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation (needed without a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@daemon_options
@one_line_errors
@pass_state
def purge(state: CliState, older_than: float | None, namespaces: tuple[str, ...], model: str | None,
          prefix: str | None, all_: bool, max_bytes: int | None, by: str, log_keep: float, from_: str,
          dry_run: bool, yes: bool, as_json: bool, daemon_endpoint: str | None, direct: bool,
          daemon_timeout: float) -> None:
    """Delete cached KV blocks by age, namespace, model, key prefix or size budget.

    Scope with --namespace / --model / --prefix; choose with --older-than, --max-bytes, --prefix or
    --all (at least one is required: a bare `kvbm purge` deletes nothing). Criteria add up: with both
    an age and a budget, blocks unused for longer than the age go, then the least recently used of the
    rest until each namespace fits in the budget. "Used" is the later of the write time and the last hit
    any daemon of the fleet recorded in the bucket's access logs (--by written ignores the logs).

    Only kvbm block keys are ever deleted: objects under the configured s3.prefix that parse as
    <namespace>/<shard>/<hash>, and <namespace>/<hh>/<hash>.kvb files in the disk directory. Other
    objects in the same bucket are never touched. Deletes go 1,000 keys per request; the run is
    idempotent, so an interrupted purge is finished by running it again. A running daemon is told
    which blocks went, so its index stays true (best effort).

    \b
    Examples:
      kvbm purge --older-than 7d --dry-run
      kvbm purge --model meta-llama/Llama-3.1-8B --all --yes
      kvbm purge --max-bytes 200GiB --from bucket --yes      # nightly budget (see scripts/cron)
    """
    if namespaces and model:
        raise click.UsageError("give --namespace or --model, not both")
    cfg = state.config
    base = cfg.s3.prefix.strip("/")
    if prefix and base and prefix.lstrip("/").startswith(base + "/"):
        prefix = prefix.lstrip("/")[len(base) + 1 :]  # a full object key was given: make it relative
    sel = Selector(namespaces=namespaces, model=model, prefix=prefix, older_than_s=older_than, all=all_,
                   max_bytes=max_bytes, shard_chars=cfg.s3.shard_chars)
    if not sel.has_criterion:
        what = "--namespace/--model only narrow the scope; " if (namespaces or model) else ""
        raise click.UsageError(f"nothing selected: {what}give --older-than, --max-bytes, --prefix or --all")
    use_disk = from_ in ("disk", "both") and cfg.disk.enabled
    use_bucket = from_ in ("bucket", "both") and cfg.s3.enabled
    if from_ == "bucket" and not cfg.s3.enabled:
        raise click.ClickException("--from bucket, but the S3 tier is disabled in this config")
    if from_ == "disk" and not cfg.disk.enabled:
        raise click.ClickException("--from disk, but the disk tier is disabled in this config")
    say = (lambda *_a, **_k: None) if as_json else click.echo
    if daemon_endpoint and not dry_run:  # named explicitly: it must answer before anything is deleted
        link, _why = find_daemon(cfg, daemon_endpoint, direct, daemon_timeout)
        if link is not None:
            link.close()
    loop = asyncio.new_event_loop()
    tier = None
    try:
        entries: list[Entry] = []
        if use_disk:
            entries += list(iter_disk(cfg.disk_dir, sel))
        if use_bucket:
            tier = loop.run_until_complete(open_bucket(cfg))

            async def listing() -> list[Entry]:
                return [e async for e in iter_bucket(tier, sel)]

            entries += loop.run_until_complete(listing())
        logs: list[AccessLog] = []
        recency = "write time"
        # A disk-only purge reads the logs of a configured bucket, but never starts the embedded SeaweedFS for it.
        if by in ("access", "value") and entries and cfg.s3.enabled and (use_bucket or cfg.s3.endpoint):
            try:
                if tier is None:  # a disk-only purge still ranks by the fleet's hits when the bucket answers
                    tier = loop.run_until_complete(open_bucket(cfg))
                nss = sel.namespaces or None
                times, logs = loop.run_until_complete(read_access_times(tier, nss))
                entries = with_access(entries, times)
                recency = f"access ({len(logs)} access logs, {len(times)} blocks with a recorded hit)"
            except KvbmError as e:
                if use_bucket:
                    raise
                recency = f"write time (bucket access logs unreadable: {' '.join(str(e).split())[:200]})"
        plan = plan_purge(entries, sel, rank="value" if by == "value" else "access")
        log_plan = plan_log_purge(logs, sel, log_keep) if use_bucket else []
        total = sum(e.size for e in plan)
        where = " and ".join(w for w, on in (("bucket", use_bucket), ("disk", use_disk)) if on) or "nothing"
        say(f"{'would delete' if dry_run else 'to delete'}: {len(plan)} blocks, {human_bytes(total)} "
            f"(of {len(entries)} in scope, from {where}; by {recency})")
        for line in _plan_lines(plan):
            say(line)
        if log_plan:
            say(f"  access logs: {len(log_plan)} old ones")
        summary: dict[str, Any] = {"dry_run": dry_run, "selected": len(plan), "selected_bytes": total,
                                   "in_scope": len(entries), "deleted": 0, "bytes_freed": 0, "errors": 0,
                                   "by": ("value" if by == "value" else "access") if recency.startswith("access")
                                   else "written",
                                   "access_logs": len(logs), "access_logs_selected": len(log_plan),
                                   "access_logs_deleted": 0}
        if dry_run or not (plan or log_plan):
            if not plan:
                say("nothing to delete")
            if as_json:
                click.echo(json.dumps(summary))
            return
        if not yes:
            if not sys.stdin.isatty():
                raise click.ClickException(f"refusing to delete {len(plan)} blocks without confirmation: "
                                           "no terminal to ask on (pass --yes, or --dry-run to look first)")
            click.confirm(f"Delete {len(plan)} blocks ({human_bytes(total)})"
                          + (f" and {len(log_plan)} old access logs" if log_plan else "") + "?", abort=True)
        guard = _disk_guard(cfg, use_disk, daemon_endpoint, direct, daemon_timeout)
        res = DeleteResult()
        logs_deleted = 0
        t0 = time.perf_counter()
        try:
            with click.progressbar(length=len(plan), label="deleting", file=sys.stderr,
                                   hidden=as_json) as bar:
                if use_disk:
                    delete_disk(cfg.disk_dir, plan, bar.update, into=res)
                if tier is not None and not res.interrupted:
                    loop.run_until_complete(delete_bucket(tier, plan, bar.update, into=res))
                if log_plan and not res.interrupted:
                    logs_deleted, log_errors = loop.run_until_complete(
                        tier.delete_many([lg.key for lg in log_plan]))  # type: ignore[union-attr]
                    res.errors += [(k, f"{code} {msg}".strip()) for k, code, msg in log_errors]
        except KeyboardInterrupt:
            res.interrupted = "interrupted (Ctrl-C)"
        finally:
            guard.release()
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        notice = _tell_daemon(cfg, res.done, use_disk, use_bucket, daemon_endpoint, direct, daemon_timeout)
        summary.update(daemon_seconds=round(time.perf_counter() - t1, 3))
        summary.update(deleted=res.deleted, bytes_freed=res.bytes, errors=len(res.errors), seconds=round(seconds, 3),
                       keys_per_s=round(res.deleted / seconds, 1) if seconds > 0 else None,
                       interrupted=res.interrupted or None, daemon=notice, access_logs_deleted=logs_deleted,
                       error_samples=[{"key": k, "error": m} for k, m in res.errors[:20]])
        if as_json:
            click.echo(json.dumps(summary))
        else:
            say(f"deleted {res.deleted} of {len(plan)} blocks, freed {human_bytes(res.bytes)} in {seconds:.1f}s; "
                f"{len(res.errors)} errors")
            for k, m in res.errors[:5]:
                say(f"  error: {k}: {m}")
            say(f"daemon: {notice}")
        if res.interrupted:
            raise click.ClickException(f"purge stopped early ({res.interrupted}); run the same command again "
                                       "to finish")
        if res.errors:
            raise click.ClickException(f"{len(res.errors)} blocks could not be deleted")
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:  # e.g. a DeleteObjects request cut short by Ctrl-C
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        if tier is not None:
            loop.run_until_complete(tier.close())
        loop.close()


def _disk_guard(cfg: Any, use_disk: bool, endpoint: str | None, direct: bool, timeout_s: float) -> DirLock:
    """A shared lock on the disk directory for a direct delete; refused while a daemon owns the directory
    unless that daemon answers (it is told what went, so its index stays true)."""
    guard = DirLock(cfg.disk_dir)
    if not use_disk:
        return guard
    try:
        return guard.acquire(shared=True)
    except DiskDirBusy as e:
        link, _why = (None, "--direct") if direct else find_daemon(cfg, endpoint, direct, timeout_s)
        if link is None:
            raise click.ClickException(
                f"{e}: a kvbm daemon owns it, and deleting its files with --direct would leave its index "
                "wrong; purge through the daemon (without --direct) or stop it first") from None
        admin = link.admin
        link.close()
        if not admin:  # the daemon would refuse the Evict that keeps its index true: delete nothing
            raise click.ClickException(
                f"{e}: a kvbm daemon owns it and purging its files needs its admin token, which this user cannot "
                f"read (daemon.admin_token_file: {admin_token_path(cfg.daemon)})") from None
        return guard


def _tell_daemon(cfg: Any, done: list[Entry], disk: bool, bucket: bool, endpoint: str | None, direct: bool,
                 timeout_s: float) -> str:
    """Best effort: ask a running daemon to drop the deleted blocks from its index (G3/G4 only)."""
    if not done:
        return "nothing to tell"
    try:
        link, why = find_daemon(cfg, endpoint, direct, timeout_s)
    except click.ClickException as e:
        return f"not told ({e.message})"
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
