"""``kvbm prewarm``: pull blocks from the bucket into the disk tier (or a daemon's host tier) ahead of demand."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import click

from kvbm.blocks import BlockKey
from kvbm.cli.common import SIZE, CliState, config_option, daemon_options, find_daemon, one_line_errors, pass_state
from kvbm.config.schema import human_bytes
from kvbm.errors import ConfigError
from kvbm.fleet.recency import read_access_times
from kvbm.ops import (
    PrewarmReport,
    Selector,
    check_namespace,
    iter_bucket,
    keys_from_hashes_file,
    keys_from_tokens_file,
    leading_runs,
    open_bucket,
    prewarm_disk,
    prewarm_host,
    rank_hottest,
    with_access,
)


class _Bar:
    """A click progress bar that shows the transfer rate."""

    def __init__(self, total: int, hidden: bool) -> None:
        self.t0 = time.perf_counter()
        self.bytes = 0
        self.bar = click.progressbar(length=max(total, 0), label="prewarming", file=sys.stderr, hidden=hidden,
                                     item_show_func=lambda _x: self._rate())

    def _rate(self) -> str:
        dt = time.perf_counter() - self.t0
        return f"{human_bytes(self.bytes / dt if dt > 0 else 0)}/s"

    def __call__(self, n: int, nbytes: int) -> None:
        self.bytes = nbytes
        self.bar.update(n, "x")

    def __enter__(self) -> _Bar:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)


async def _available(tier: Any, namespace: str, keys: list[BlockKey] | None) -> dict[BlockKey, int]:
    """Object size of each block the bucket holds: a LIST of the namespace, or HEAD per key."""
    if keys is None:
        sel = Selector(namespaces=(namespace,), shard_chars=tier.shard_chars)
        return {e.key: e.size async for e in iter_bucket(tier, sel)}
    heads = await tier.head_many(keys)
    return {k: v["size"] for k, v in heads.items() if v is not None}


@click.command("prewarm")
@config_option
@click.option("--namespace", metavar="NS", required=True,
              help="Layout namespace (<model-slug>-<16 hex>). Alone: every block of it in the bucket.")
@click.option("--hashes", "hashes_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Only these blocks: one hex block hash per line.")
@click.option("--tokens", "tokens_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Only the blocks of these prompts: one JSON list of token ids per line.")
@click.option("--block-tokens", type=click.IntRange(min=1), help="Tokens per kvbm block (with --tokens).")
@click.option("--hash-scheme", type=click.Choice(["kvbm", "vllm"]), default=None,
              help="Block hash scheme for --tokens (default: hash_scheme of the config).")
@click.option("--vllm-block-size", type=click.IntRange(min=1), default=None,
              help="vLLM's block size for --hash-scheme vllm (default: --block-tokens).")
@click.option("--salt", default=None, help="Cache salt the prompts were hashed with (--tokens).")
@click.option("--lora", default=None, help="LoRA name the prompts were hashed with (--tokens).")
@click.option("--hottest", type=click.IntRange(min=1), default=None, metavar="N",
              help="Only the N most recently used blocks of the namespace, fleet-wide (the bucket's access logs; "
                   "write time where no hit is recorded).")
@click.option("--hottest-bytes", "hottest_bytes", metavar="SIZE", type=SIZE, default=None,
              help="Only the most recently used blocks that fit in SIZE (e.g. 50GiB); with --hottest, both limits.")
@click.option("--to", "to", type=click.Choice(["disk", "host"]), default="disk", show_default=True,
              help="disk: write block files into the disk tier's directory; host: have the running daemon "
                   "onboard them into its host (G2) tier.")
@click.option("--concurrency", type=click.IntRange(min=1, max=256), default=8, show_default=True,
              help="Bucket reads in flight at once (--to disk).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@daemon_options
@one_line_errors
@pass_state
def prewarm(state: CliState, namespace: str, hashes_file: str | None, tokens_file: str | None,
            block_tokens: int | None, hash_scheme: str | None, vllm_block_size: int | None, salt: str | None,
            lora: str | None, hottest: int | None, hottest_bytes: int | None, to: str, concurrency: int,
            as_json: bool, daemon_endpoint: str | None, direct: bool, daemon_timeout: float) -> None:
    """Pull KV blocks from the bucket into a faster tier before requests need them.

    Choose the blocks with --namespace alone (all of it), --hottest N / --hottest-bytes SIZE (the fleet's most
    recently used blocks of it: how a new node joins warm), --hashes FILE or --tokens FILE (prompts as token
    ids, hashed like the manager does: give --block-tokens and, for vLLM-keyed caches, --hash-scheme vllm
    --vllm-block-size). For prompts only the leading run of blocks up to the first one the bucket lacks is
    fetched (a prefix lookup can never reach past a gap).

    --to disk (default) copies objects into the disk tier's directory with --concurrency reads in flight,
    skipping blocks already there and stopping at the disk capacity; it works without a daemon (a running
    daemon indexes these files when it restarts). --to host needs a running daemon: it onboards the
    blocks into the daemon's host tier, so its index knows them at once.

    \b
    Examples:
      kvbm prewarm --namespace llama-3-8b-0123456789abcdef
      kvbm prewarm --namespace NS --hottest 20000 --hottest-bytes 200GiB
      kvbm prewarm --namespace NS --tokens prompts.jsonl --block-tokens 64 --concurrency 16
      kvbm prewarm --namespace NS --hashes hot.txt --to host --daemon ipc:///run/kvbm.sock

    The report lists what was fetched (blocks, bytes, bytes/s) and what was missing from the bucket.
    """
    try:
        check_namespace(namespace)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--namespace") from None
    if hashes_file and tokens_file:
        raise click.UsageError("give --hashes or --tokens, not both")
    if (hottest or hottest_bytes) and (hashes_file or tokens_file):
        raise click.UsageError("--hottest/--hottest-bytes pick from the whole namespace; not with --hashes/--tokens")
    budget = hottest_bytes
    if tokens_file and not block_tokens:
        raise click.UsageError("--tokens needs --block-tokens (tokens per kvbm block)")
    if (block_tokens or vllm_block_size or hash_scheme or salt or lora) and not tokens_file:
        raise click.UsageError("--block-tokens/--hash-scheme/--vllm-block-size/--salt/--lora only apply to --tokens")
    cfg = state.config
    if not cfg.s3.enabled:
        raise click.ClickException("the S3 tier is disabled in this config: nothing to prewarm from")
    if to == "disk" and not cfg.disk.enabled:
        raise click.ClickException("--to disk, but the disk tier is disabled in this config")
    keys: list[BlockKey] | None = None
    chains: list[list[BlockKey]] | None = None
    if hashes_file:
        keys = keys_from_hashes_file(hashes_file, namespace)
    elif tokens_file:
        assert block_tokens is not None
        chains = keys_from_tokens_file(tokens_file, namespace, block_tokens, hash_scheme or cfg.hash_scheme,
                                       vllm_block_size, salt, lora)
        keys = list(dict.fromkeys(k for c in chains for k in c))
    link = None
    note = ""
    if to == "host":
        if direct:
            raise click.UsageError("--to host works through the daemon; it cannot be combined with --direct")
        link, why = find_daemon(cfg, daemon_endpoint, False, daemon_timeout)
        if link is None:
            raise click.ClickException(f"--to host needs a running daemon (its host tier lives in its memory): {why}")
    report = PrewarmReport()
    try:
        hot = (hottest, budget) if (hottest or budget is not None) else None
        report = asyncio.run(_run(cfg, namespace, keys, chains, to, concurrency, link, report, as_json, hot))
    finally:
        if link is not None:
            link.close()
    if to == "disk" and not direct and report.fetched:
        # A daemon over the same disk directory re-reads it, so its index knows the new files at once.
        probe, _why = find_daemon(cfg, daemon_endpoint, False, daemon_timeout)
        if probe is not None:
            try:
                added = probe.reindex(namespace, ["G3"])
                note = f"the daemon at {probe.endpoint} indexed them ({added} new blocks in its G3)"
            except Exception as e:  # best effort: the files are written either way
                note = f"the daemon at {probe.endpoint} could not re-index its disk tier ({e}); it will on restart"
            finally:
                probe.close()
    out = report.as_dict()
    out.update(to=to, namespace=namespace, note=note or None)
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"prewarm {namespace} -> {to}: {report.requested} blocks requested, {report.present} already there, "
               f"{report.fetched} fetched ({human_bytes(report.bytes)} in {report.seconds:.2f}s, "
               f"{human_bytes(report.rate)}/s)")
    if report.missing:
        click.echo(f"missing: {len(report.missing)} blocks not in the "
                   f"{'daemon index' if to == 'host' else 'bucket'}"
                   + (f"; {report.unreachable} more after a gap in their prompt were skipped" if report.unreachable
                      else ""))
        for k in report.missing[:10]:
            click.echo(f"  {k}")
        if len(report.missing) > 10:
            click.echo(f"  ... and {len(report.missing) - 10} more (--json lists up to 1000)")
    if report.no_room:
        click.echo(f"skipped: {report.no_room} blocks, the disk tier is full (disk.capacity {cfg.disk.capacity})")
    if report.failed:
        click.echo(f"failed: {len(report.failed)} blocks")
        for k, e in report.failed[:5]:
            click.echo(f"  {k}: {e}")
    if note:
        click.echo(f"note: {note}")
    if report.failed:
        raise click.ClickException(f"{len(report.failed)} blocks could not be prewarmed")


async def _run(cfg: Any, namespace: str, keys: list[BlockKey] | None, chains: list[list[BlockKey]] | None, to: str,
               concurrency: int, link: Any, report: PrewarmReport, quiet: bool,
               hot: tuple[int | None, int | None] | None = None) -> PrewarmReport:
    if to == "host" and keys is not None:
        # The daemon knows what it holds; ask it directly (no bucket round trips here).
        groups = chains if chains is not None else [keys]
        report.requested = len(keys)
        with _Bar(sum(len(g) for g in groups), quiet) as bar:
            await asyncio.to_thread(prewarm_host, link, groups, report, chains=chains is not None, progress=bar)
        return report
    tier = await open_bucket(cfg)
    try:
        if hot is not None:
            sel = Selector(namespaces=(namespace,), shard_chars=tier.shard_chars)
            entries = [e async for e in iter_bucket(tier, sel)]
            times, _logs = await read_access_times(tier, [namespace])
            ranked = rank_hottest(with_access(entries, times), *hot)
            avail = {e.key: e.size for e in ranked}
            keys = [e.key for e in ranked]
        else:
            avail = await _available(tier, namespace, keys)
        if hot is not None:
            report.requested = len(keys)  # type: ignore[arg-type]
            wanted = keys
        elif keys is None:
            keys = sorted(avail, key=lambda k: k.hash)
            report.requested = len(keys)
            wanted = keys
        elif chains is not None:
            report.requested = len(keys)
            wanted = leading_runs(chains, set(avail), report)
        else:
            report.requested = len(keys)
            report.missing = [k for k in keys if k not in avail]
            wanted = [k for k in keys if k in avail]
        if to == "host":
            with _Bar(len(wanted), quiet) as bar:
                await asyncio.to_thread(prewarm_host, link, [wanted], report, progress=bar)
            return report
        with _Bar(len(wanted), quiet) as bar:
            return await prewarm_disk(cfg, tier, [(k, avail[k]) for k in wanted], report, concurrency, bar)
    finally:
        await tier.close()
