"""``kvbm bench``: throughput and latency benchmarks (tiers, manager, long-doc-qa, fleet, serve, trace, native).

Each subcommand prints a table, writes JSON with ``--json PATH`` (machine description, options and
every figure) and draws a PNG with ``--plot PATH``. Runs use temp dirs, a dedicated bucket prefix on
a loopback S3 endpoint (a fresh embedded SeaweedFS unless ``--s3-endpoint`` names one) and clean up.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import click

from kvbm.cli.common import SIZE


def _csv(value: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in value.split(",") if s.strip())


def _emit(report: dict[str, Any], json_path: str | None, plot_path: str | None, plot: Any) -> None:
    from kvbm.bench.common import write_json

    if plot_path:
        try:
            plot(report, plot_path)
            report.setdefault("plots", []).append(plot_path)
            click.echo(f"plot: {plot_path}")
        except ImportError as e:
            click.echo(f"no plot ({e}); pip install 'kvbm[bench]'", err=True)
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")


def _run_checked(opts: Any, run: Any, name: str) -> dict[str, Any]:
    """Check ``opts`` (a bad option is the CLI's usage error), run the bench (a bad input file it names is the
    CLI's error), and stamp the command line that ran it."""
    import sys

    try:
        opts.check()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        report = asyncio.run(run(opts, click.echo))
    except ValueError as e:  # e.g. a bad trace line, named with its field
        raise click.ClickException(str(e)) from None
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index(name):]] if name in sys.argv else sys.argv
    return report


@click.group()
def bench() -> None:
    """Benchmarks of kvbm's data paths (not tests: they measure this machine)."""
    logging.getLogger("kvbm").setLevel(logging.WARNING)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's python API logs every agent at INFO
    logging.getLogger("nixl").setLevel(logging.WARNING)


s3_opts = [
    click.option("--s3-endpoint", default=None, help="Use this loopback S3 endpoint instead of a fresh SeaweedFS."),
    click.option("--s3-access-key", default="", envvar="AWS_ACCESS_KEY_ID", show_envvar=True),
    click.option("--s3-secret-key", default="", envvar="AWS_SECRET_ACCESS_KEY", show_envvar=True),
    click.option("--s3-bucket", default="kvbm-bench", show_default=True,
                 help="Bucket (objects go under a fresh prefix)."),
]


def with_s3(fn: Any) -> Any:
    for opt in reversed(s3_opts):
        fn = opt(fn)
    return fn


model_opts = [  # the random Llama of the benches that drive vLLM's OpenAI server (RandomModelOptions)
    click.option("--layers", default=8, show_default=True),
    click.option("--hidden", default=1024, show_default=True),
    click.option("--heads", default=8, show_default=True),
    click.option("--kv-heads", default=4, show_default=True),
    click.option("--vocab", default=8192, show_default=True),
    click.option("--dtype", default="auto", show_default=True,
                 type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
                 help="Weights and KV; auto: bfloat16 on a GPU or a CPU with AVX-512/AMX/Arm, float32 on an AVX2 "
                 "CPU (which emulates bf16 ~90x slower)."),
]


def with_model(fn: Any) -> Any:
    for opt in reversed(model_opts):
        fn = opt(fn)
    return fn


@bench.command("tiers")
@click.option("--block-size", type=SIZE, default="8MiB", show_default=True, help="Block size (e.g. 8MiB, 512KiB).")
@click.option("--blocks", default=64, show_default=True, help="Blocks per run.")
@click.option("--repeats", default=3, show_default=True, help="Runs per path (the median is reported).")
@click.option("--groups", default="memory,disk,s3", show_default=True, help="Which groups of paths to run.")
@click.option("--s3-clients", default="aiobotocore,nixl", show_default=True, help="S3Tier clients to run.")
@click.option("--file-io", default="auto", show_default=True,
              help="transfer.backend values for G3 (auto, plain, nixl), comma separated.")
@click.option("--disk-modes", default="direct,buffered", show_default=True, help="G3 with O_DIRECT and/or buffered.")
@click.option("--boto3-threads", default=8, show_default=True, help="Threads of the boto3 baseline.")
@click.option("--s3-concurrency", default=8, show_default=True, help="s3.max_concurrency of the kvbm S3 tier.")
@click.option("--s3-reference/--no-s3-reference", default=True, show_default=True,
              help="Also time plain aiobotocore (the S3Tier's library) without kvbm.")
@click.option("--peer-python", type=click.Path(dir_okay=False), default=None, envvar="KVBM_BENCH_PEER_PYTHON",
              show_envvar=True, help="Python of a venv with LMCache (scripts/lmcache_venv.sh): run its S3 connector "
              "against the same server and put its rows next to kvbm's.")
@click.option("--peer-domain", default="s3.kvbm.test", show_default=True,
              help="SeaweedFS -s3.domainName for the peer (it addresses <bucket>.<domain>).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the report here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Draw a PNG here.")
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def tiers_cmd(block_size: int, blocks: int, repeats: int, groups: str, s3_clients: str, file_io: str,
              disk_modes: str, boto3_threads: int, s3_concurrency: int, s3_reference: bool, peer_python: str | None,
              peer_domain: str, workdir: str | None,
              s3_endpoint: str | None,
              s3_access_key: str, s3_secret_key: str, s3_bucket: str, json_path: str | None, plot_path: str | None,
              markdown: bool) -> None:
    """Throughput of G1<->G2, G2<->G3 and G2<->G4 through the manager, each next to a raw baseline."""
    from kvbm.bench.report import plot_tiers, tiers_table
    from kvbm.bench.tiers import TiersOptions, run_tiers

    if blocks < 1 or repeats < 1:
        raise click.BadParameter("--blocks and --repeats must be >= 1")
    opts = TiersOptions(
        block_bytes=block_size, blocks=blocks, repeats=repeats, groups=_csv(groups),
        s3_clients=_csv(s3_clients), file_io=_csv(file_io), disk_modes=_csv(disk_modes),
        boto3_threads=boto3_threads, s3_concurrency=s3_concurrency, s3_reference=s3_reference, workdir=workdir,
        peer_python=peer_python, peer_domain=peer_domain,
        s3_endpoint=s3_endpoint,
        s3_access_key=s3_access_key, s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
    )
    if peer_python and "s3" not in opts.groups:
        raise click.BadParameter("the peer runs in the s3 group", param_hint="--peer-python")
    if peer_python and s3_endpoint:
        raise click.BadParameter("the peer needs the bench's own SeaweedFS (started with -s3.domainName)",
                                 param_hint="--peer-python")
    report = asyncio.run(run_tiers(opts, click.echo))
    click.echo("")
    click.echo(tiers_table(report, markdown))
    _emit(report, json_path, plot_path, plot_tiers)
    if report.get("peer_error"):
        raise click.ClickException(report["peer_error"])


@bench.command("manager")
@click.option("--registered", default=1_000_000, show_default=True, help="Blocks registered for the lookup figures.")
@click.option("--prefix-blocks", default=1000, show_default=True, help="Blocks per looked-up prefix.")
@click.option("--lookups", default=1000, show_default=True, help="In-process lookups timed.")
@click.option("--daemon", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
              help="Also measure through the daemon's socket (when kvbm.daemon exists).")
@click.option("--daemon-events", default=50_000, show_default=True, help="Block events sent through the daemon.")
@click.option("--daemon-batch", default=64, show_default=True, help="Blocks per store request.")
@click.option("--daemon-lookups", default=500, show_default=True, help="Lookups timed through the daemon.")
@click.option("--daemon-registered", default=None, type=int,
              help="Blocks registered in the daemon before its lookups [default: --registered].")
@click.option("--onboard-blocks", default=32, show_default=True, help="Blocks per onboard (overhead figure).")
@click.option("--block-size", type=SIZE, default="8MiB", show_default=True, help="Block size of the onboard figure.")
@click.option("--repeats", default=3, show_default=True,
              help="Repeats of the registry, lookup and onboard figures (the median is reported).")
@click.option("--groups", default="ingest,lookup,memory,daemon,onboard", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def manager_cmd(registered: int, prefix_blocks: int, lookups: int, daemon: str, daemon_events: int, daemon_batch: int,
                daemon_lookups: int, daemon_registered: int | None, onboard_blocks: int, block_size: int, repeats: int,
                groups: str, workdir: str | None, s3_endpoint: str | None, s3_access_key: str, s3_secret_key: str,
                s3_bucket: str, json_path: str | None, markdown: bool) -> None:
    """Event ingest rate, prefix lookup latency, index memory per block and onboard overhead."""
    from kvbm.bench.manager import ManagerOptions, run_manager
    from kvbm.bench.report import manager_table

    if registered < prefix_blocks:
        raise click.BadParameter("--registered must be >= --prefix-blocks")
    opts = ManagerOptions(
        registered=registered, prefix_blocks=prefix_blocks, lookups=lookups, daemon=daemon,
        daemon_events=max(daemon_events, prefix_blocks + daemon_batch), daemon_batch=daemon_batch,
        daemon_lookups=daemon_lookups, daemon_registered=daemon_registered, onboard_blocks=onboard_blocks,
        block_bytes=block_size,
        onboard_repeats=repeats, groups=_csv(groups), workdir=workdir, s3_endpoint=s3_endpoint,
        s3_access_key=s3_access_key, s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
    )
    report = asyncio.run(run_manager(opts, click.echo))
    click.echo("")
    click.echo(manager_table(report, markdown))
    _emit(report, json_path, None, None)


@bench.command("long-doc-qa")
@click.option("--engine", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True,
              help="torch: a tiny decoder in this process, kvbm's manager in-process. vllm: a real vLLM (CPU build) "
              "with KvbmConnector against a `kvbm serve` daemon, per TP size.")
@click.option("--doc-lengths", default=None, help="Document lengths in tokens [torch: 1024,4096,8192; vllm: 4000].")
@click.option("--docs", default=None, type=int, help="Documents per length [torch: 2; vllm: 1].")
@click.option("--queries", default=None, type=int,
              help="Queries per document and source [torch: 2; vllm: 3, the median is reported].")
@click.option("--query-tokens", default=32, show_default=True, help="Question tokens after the document.")
@click.option("--order", type=click.Choice(["tile", "random"]), default="tile", show_default=True, help="torch only.")
@click.option("--inflight", default=1, show_default=True, help="Requests in flight at once (torch only).")
@click.option("--sources", default=None,
              help="What to time [torch: recompute,G2,G3,G4; vllm: recompute,tail,G1,G2,G3,G4; G1 is the hits' b].")
@click.option("--layers", default=None, type=int, help="[torch: 4; vllm: 8]")
@click.option("--hidden", default=None, type=int, help="[torch: 256; vllm: 1024]")
@click.option("--heads", default=None, type=int, help="Attention heads [torch: 4; vllm: 8].")
@click.option("--kv-heads", default=4, show_default=True, help="KV heads of the vLLM model (vllm only).")
@click.option("--intermediate", default=None, type=int, help="MLP size of the vLLM model [2.75 x hidden].")
@click.option("--vocab", default=None, type=int, help="[torch: 32000; vllm: 8192]")
@click.option("--tokens-per-block", default=256, show_default=True,
              help="Tokens per kvbm block (vllm: a multiple of its 128-token blocks).")
@click.option("--tp", default="1,2", show_default=True, help="Tensor-parallel sizes (vllm only).")
@click.option("--connector-extra", default="{}", show_default=True,
              help="JSON merged into KvbmConnector's kv_connector_extra_config (vllm only), "
              "e.g. '{\"async_load\": false}'.")
@click.option("--logs", type=click.Path(file_okay=False), default=None,
              help="Keep each engine's and daemon's log in this directory (vllm only).")
@click.option("--cpu-bind", type=click.Choice(["rank", "shared"]), default="rank", show_default=True,
              help="TP>1 (vllm only): rank = each rank's threads on one core of its own (VLLM_CPU_OMP_THREADS_BIND="
              "0|1); shared = every rank on all cores.")
@click.option("--request-timeout", default=300.0, show_default=True,
              help="Seconds one timed request may run before its engine is stopped and it is reported as stalled "
              "(vllm only).")
@click.option("--s3-client", type=click.Choice(["aiobotocore", "nixl"]), default="aiobotocore", show_default=True,
              help="torch only (the vllm engine's daemon uses its default).")
@click.option("--seed", default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="TTFT PNG.")
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def longdoc_cmd(engine: str, doc_lengths: str | None, docs: int | None, queries: int | None, sources: str | None,
                **kw: Any) -> None:
    """TTFT of document QA: recompute vs kvbm hits from G2, G3 and G4, by document length."""
    vllm = engine == "vllm"
    lengths = tuple(int(x) for x in _csv(doc_lengths or ("4000" if vllm else "1024,4096,8192")))
    docs = docs if docs is not None else (1 if vllm else 2)
    queries = queries if queries is not None else (3 if vllm else 2)
    if docs < 1 or queries < 1 or kw["inflight"] < 1 or kw["query_tokens"] < 1:
        raise click.BadParameter("--docs, --queries, --query-tokens and --inflight must be >= 1")
    out = {k: kw.pop(k) for k in ("json_path", "plot_path", "markdown")}
    s3 = {k: kw.pop(k) for k in ("s3_endpoint", "s3_access_key", "s3_secret_key", "s3_bucket", "workdir", "seed")}
    if vllm:
        _longdoc_vllm(lengths, docs, queries, sources, kw, s3, **out)
        return
    from kvbm.bench.longdoc import LongDocOptions, run_longdoc
    from kvbm.bench.report import longdoc_table, plot_longdoc

    if any(n < kw["tokens_per_block"] for n in lengths):
        raise click.BadParameter("every document must hold at least one block", param_hint="--doc-lengths")
    opts = LongDocOptions(
        doc_lengths=lengths, docs=docs, queries=queries, query_tokens=kw["query_tokens"], order=kw["order"],
        inflight=kw["inflight"], sources=_csv(sources or "recompute,G2,G3,G4"), layers=kw["layers"] or 4,
        hidden=kw["hidden"] or 256, heads=kw["heads"] or 4, vocab=kw["vocab"] or 32000,
        tokens_per_block=kw["tokens_per_block"], s3_client=kw["s3_client"], **s3,
    )
    report = asyncio.run(run_longdoc(opts, click.echo))
    click.echo("")
    click.echo(longdoc_table(report, out["markdown"]))
    _emit(report, out["json_path"], out["plot_path"], plot_longdoc)


def _longdoc_vllm(lengths: tuple[int, ...], docs: int, queries: int, sources: str | None, kw: dict[str, Any],
                  s3: dict[str, Any], json_path: str | None, plot_path: str | None, markdown: bool) -> None:
    import json

    from kvbm.bench.longdoc_vllm import SOURCES, VLLM_BLOCK, VllmLongDocOptions, run_longdoc_vllm
    from kvbm.bench.report import longdoc_vllm_table, plot_longdoc_vllm

    if kw["tokens_per_block"] % VLLM_BLOCK:
        raise click.BadParameter(f"must be a multiple of vLLM's {VLLM_BLOCK}-token blocks",
                                 param_hint="--tokens-per-block")
    try:
        extra = json.loads(kw["connector_extra"])
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--connector-extra") from None
    if not isinstance(extra, dict):
        raise click.BadParameter("a JSON object", param_hint="--connector-extra")
    hidden = kw["hidden"] or 1024
    opts = VllmLongDocOptions(
        doc_lengths=lengths, docs=docs, queries=queries, query_tokens=kw["query_tokens"],
        tp=tuple(int(x) for x in _csv(kw["tp"])), layers=kw["layers"] or 8, hidden=hidden, heads=kw["heads"] or 8,
        kv_heads=kw["kv_heads"], intermediate=kw["intermediate"] or int(hidden * 2.75), vocab=kw["vocab"] or 8192,
        vllm_blocks_per_kvbm_block=kw["tokens_per_block"] // VLLM_BLOCK, sources=_csv(sources or ",".join(SOURCES)),
        connector=extra, logs=kw["logs"], request_timeout_s=kw["request_timeout"], cpu_bind=kw["cpu_bind"], **s3,
    )
    try:
        opts.check()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    report = asyncio.run(run_longdoc_vllm(opts, click.echo))
    click.echo("")
    click.echo(longdoc_vllm_table(report, markdown))
    _emit(report, json_path, plot_path, plot_longdoc_vllm)


@bench.command("fleet")
@click.option("--daemons", default=2, show_default=True, help="Daemons sharing the bucket (at least 2).")
@click.option("--blocks", default=20, show_default=True, help="Blocks stored durably on A, looked up on B.")
@click.option("--hit-timeout", default=10.0, show_default=True, help="Seconds B may take to find a block.")
@click.option("--lookups", default=200, show_default=True, help="Lookups timed on B (misses and G2 hits).")
@click.option("--block-size", type=SIZE, default="64KiB", show_default=True)
@click.option("--listing-sizes", default="100000,1000000", show_default=True,
              help="Bucket sizes (block objects) to list, comma separated.")
@click.option("--listing-prefix", default="", help="Keep the listing objects under this prefix and reuse them.")
@click.option("--put-concurrency", default=128, show_default=True, help="PUTs in flight creating listing objects.")
@click.option("--list-concurrency", default=16, show_default=True, help="s3.list_concurrency of the parallel listing.")
@click.option("--groups", default="fleet,listing", show_default=True, help="Of fleet, listing, fanout.")
@click.option("--fanout-daemons", default=8, show_default=True, help="fanout: daemons that discover each other.")
@click.option("--rounds", default=16, show_default=True, help="fanout: blocks stored (each by the next daemon).")
@click.option("--modes", default="events,probe", show_default=True, help="fanout: events (discovery), probe.")
@click.option("--negative-ttl", default=1.0, show_default=True, help="fanout: daemon.probe_negative_ttl_s.")
@click.option("--cluster", is_flag=True, help="Run on a fresh SeaweedFS cluster (3 volume servers, 001, 2 gateways).")
@click.option("--kill-volume", is_flag=True, help="With --cluster: kill a volume server halfway (fanout, events).")
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go.")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def fleet_cmd(daemons: int, blocks: int, hit_timeout: float, lookups: int, block_size: int, listing_sizes: str,
              listing_prefix: str, put_concurrency: int, list_concurrency: int, groups: str, fanout_daemons: int,
              rounds: int, modes: str, negative_ttl: float, cluster: bool, kill_volume: bool, workdir: str | None,
              s3_endpoint: str | None, s3_access_key: str, s3_secret_key: str, s3_bucket: str,
              json_path: str | None, markdown: bool) -> None:
    """N daemons on one bucket: A's durable ack to B's hit, lookup cost, and listing 100k/1M block objects."""
    from kvbm.bench.fleet import FleetOptions, fleet_table, run_fleet

    if daemons < 2 or blocks < 1 or lookups < 1 or fanout_daemons < 2 or rounds < 1:
        raise click.BadParameter("--daemons and --fanout-daemons must be >= 2, --blocks, --lookups, --rounds >= 1")
    bad = [m for m in _csv(modes) if m not in ("events", "probe")]
    if bad or (kill_volume and not cluster) or (cluster and s3_endpoint):
        raise click.BadParameter(f"--modes: events/probe, not {bad}" if bad else
                                 "--kill-volume needs --cluster" if kill_volume and not cluster else
                                 "--cluster starts its own store: no --s3-endpoint")
    opts = FleetOptions(
        daemons=daemons, blocks=blocks, hit_timeout_s=hit_timeout, lookups=lookups,
        block_bytes=block_size,
        listing_sizes=tuple(int(x) for x in _csv(listing_sizes)), listing_prefix=listing_prefix.strip("/"),
        put_concurrency=put_concurrency, list_concurrency=list_concurrency, groups=_csv(groups), workdir=workdir,
        fanout_daemons=fanout_daemons, fanout_rounds=rounds, fanout_modes=_csv(modes), negative_ttl_s=negative_ttl,
        cluster=cluster, kill_volume=kill_volume, s3_endpoint=s3_endpoint, s3_access_key=s3_access_key,
        s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
    )
    report = asyncio.run(run_fleet(opts, click.echo))
    click.echo("")
    click.echo(fleet_table(report, markdown))
    _emit(report, json_path, None, None)


@bench.command("serve")
@click.option("--workloads", default="long-doc-qa,ttft-length", show_default=True,
              help="long-doc-qa, ttft-length, multi-turn (comma separated).")
@click.option("--sources", default="vllm,kvbm,lmcache,offloading", show_default=True,
              help="Servers to run, one at a time: vllm (no connector: recompute and its own prefix cache, G1), kvbm "
              "(KvbmConnector + a kvbm serve daemon: G2/G3/G4), lmcache (LMCacheConnectorV1), offloading (vLLM's "
              "OffloadingConnector); a peer that cannot run here is recorded with its error.")
@click.option("--docs", default=16, show_default=True, help="long-doc-qa: documents.")
@click.option("--doc-tokens", default=6000, show_default=True, help="long-doc-qa: tokens per document.")
@click.option("--queries", default=2, show_default=True, help="long-doc-qa: queries per document (tile order).")
@click.option("--query-tokens", default=32, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="long-doc-qa: requests in flight.")
@click.option("--lengths", default="1000,2000,4000,8000,16000", show_default=True,
              help="ttft-length: input lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, help="ttft-length: prompts per length (P95 over them).")
@click.option("--s3-clients", default="http,nixl,aiobotocore", show_default=True,
              help="ttft-length: the daemon's S3 clients timed for G4 hits (restarted with each).")
@click.option("--sessions", default=2, show_default=True, help="multi-turn: conversations.")
@click.option("--turns", default=4, show_default=True, help="multi-turn: turns per conversation.")
@click.option("--turn-tokens", default=512, show_default=True, help="multi-turn: new tokens per turn.")
@click.option("--max-tokens", default=16, show_default=True, help="Output tokens per request (greedy, ignore_eos).")
@click.option("--vllm-kv", type=SIZE, default="1GiB", show_default=True,
              help="vLLM's KV space (--kv-cache-memory-bytes).")
@click.option("--g2", type=SIZE, default="256MiB", show_default=True,
              help="The daemon's G2 (host) capacity in long-doc-qa.")
@click.option("--g3", type=SIZE, default="768MiB", show_default=True,
              help="The daemon's G3 (disk) capacity in long-doc-qa.")
@click.option("--block-size", default=128, show_default=True, help="vLLM block size (CPU: a multiple of 32).")
@click.option("--tokens-per-block", default=256, show_default=True, help="Tokens per kvbm block.")
@with_model
@click.option("--omp-threads", default=2, show_default=True, help="OMP_NUM_THREADS of each vLLM server.")
@click.option("--server-python", default=None, help="Interpreter the vLLM servers run in [this one].")
@click.option("--peer-python", default=None, help="Interpreter of the peers' servers (a venv with LMCache) [this one].")
@click.option("--request-timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.option("--logs", type=click.Path(file_okay=False), default=None, help="Keep the servers' and daemon's logs.")
@click.option("--seed", default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="PNG (four panels).")
@click.option("--markdown", is_flag=True, help="Print the tables as markdown.")
def serve_cmd(workloads: str, sources: str, lengths: str, s3_clients: str, vllm_kv: int, g2: int, g3: int,
              tokens_per_block: int, block_size: int, request_timeout: float, json_path: str | None,
              plot_path: str | None, markdown: bool, **kw: Any) -> None:
    """vLLM's OpenAI server over HTTP (streamed, C in flight): recompute, vLLM's prefix cache, kvbm, peers."""

    from kvbm.bench.openai_server import native_dtype
    from kvbm.bench.serve import ServeBenchOptions, plot_serve, run_serve, serve_table

    if kw["dtype"] == "auto":
        kw["dtype"] = native_dtype()
    if tokens_per_block % block_size:
        raise click.BadParameter(f"a multiple of --block-size {block_size}", param_hint="--tokens-per-block")
    opts = ServeBenchOptions(
        workloads=_csv(workloads), sources=_csv(sources), lengths=tuple(int(x) for x in _csv(lengths)),
        s3_clients=_csv(s3_clients), vllm_kv_bytes=vllm_kv, g2_bytes=g2,
        g3_bytes=g3, block_size=block_size,
        vllm_blocks_per_kvbm_block=tokens_per_block // block_size, request_timeout_s=request_timeout, **kw)
    report = _run_checked(opts, run_serve, "serve")
    click.echo("")
    click.echo(serve_table(report, markdown))
    _emit(report, json_path, plot_path, plot_serve)


@bench.command("trace")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, exists=True), required=True,
              help="A Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids).")
@click.option("--limit", default=0, show_default=True, help="Replay only the first N requests (0: all).")
@click.option("--speedup", default=20.0, show_default=True, help="Timestamps are divided by this.")
@click.option("--block-size", type=SIZE, default="32KiB", show_default=True, help="Bytes per trace block (a hash_id).")
@click.option("--capacities", default="0.01,0.03", show_default=True,
              help="G2+G3 capacity as shares of the trace's distinct blocks, comma separated.")
@click.option("--g2-share", default=0.25, show_default=True, help="G2's part of G2+G3.")
@click.option("--s3", "s3_modes", default="off", show_default=True, help="off, on or off,on (G4 behind G2+G3).")
@click.option("--inflight", default=8, show_default=True, help="Requests in flight at most.")
@click.option("--eviction", "evictions", default="lru", show_default=True,
              help="The daemon's policy.eviction: lru, frequency or lru,frequency (a run each).")
@click.option("--g3-dir", default="", help="Where G3 lives (e.g. a tmpfs: the policy without the disk's latency).")
@click.option("--seed", default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG: hit ratio vs capacity, per tier, with LRU / policy / Belady.")
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def trace_cmd(trace_path: str, limit: int, speedup: float, block_size: int, capacities: str, g2_share: float,
              s3_modes: str, inflight: int, evictions: str, g3_dir: str, seed: int, workdir: str | None,
              s3_endpoint: str | None,
              s3_access_key: str, s3_secret_key: str, s3_bucket: str, json_path: str | None, plot_path: str | None,
              markdown: bool) -> None:
    """Replay a production trace through a real daemon: hit ratio per tier vs LRU / Belady / infinite."""

    from kvbm.bench.trace import TraceOptions, plot_trace, run_trace, trace_table

    try:
        caps = tuple(float(x) for x in _csv(capacities))
    except ValueError:
        raise click.BadParameter(f"numbers, not {capacities!r}", param_hint="--capacities") from None
    opts = TraceOptions(trace=trace_path, limit=limit, speedup=speedup,
                        block_bytes=block_size, capacities=caps, g2_share=g2_share,
                        s3_modes=_csv(s3_modes), inflight=inflight, evictions=_csv(evictions), g3_dir=g3_dir,
                        seed=seed, workdir=workdir,
                        s3_endpoint=s3_endpoint, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key,
                        s3_bucket=s3_bucket)
    report = _run_checked(opts, run_trace, "trace")
    click.echo("")
    click.echo(trace_table(report, markdown))
    _emit(report, json_path, plot_path, plot_trace)


@bench.command("trace-serve")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, exists=True), required=True,
              help="A Mooncake-format JSONL trace.")
@click.option("--conversations", default=12, show_default=True, help="Conversations (2+ turns) in the slice.")
@click.option("--turns", default=4, show_default=True, help="Requests kept per conversation.")
@click.option("--max-blocks", default=48, show_default=True, help="Hash ids kept per request (its prefix).")
@click.option("--tokens-per-id", default=64, show_default=True,
              help="Tokens per hash id: one vLLM block (a multiple of 32).")
@click.option("--speedup", default=200.0, show_default=True, help="Timestamps are divided by this.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at most.")
@click.option("--max-tokens", default=8, show_default=True, help="Output tokens per request (greedy).")
@click.option("--sources", default="vllm,kvbm", show_default=True, help="vllm (alone), kvbm (vLLM + kvbm).")
@click.option("--g1-share", default=0.25, show_default=True,
              help="vLLM's KV space, as a share of the slice's distinct tokens.")
@click.option("--g2-share", default=0.25, show_default=True, help="G2, as a share of the slice's distinct blocks.")
@click.option("--s3/--no-s3", default=True, show_default=True, help="G4 (S3) behind G2 and G3.")
@with_model
@click.option("--seed", default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Where temp dirs go (a real disk).")
@with_s3
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def trace_serve_cmd(trace_path: str, sources: str, json_path: str | None, markdown: bool, **kw: Any) -> None:
    """A conversation slice of a trace through vLLM's OpenAI server: vLLM alone vs vLLM + kvbm."""

    from kvbm.bench.openai_server import native_dtype
    from kvbm.bench.trace_serve import TraceServeOptions, run_trace_serve, trace_serve_table

    if kw["dtype"] == "auto":
        kw["dtype"] = native_dtype()
    opts = TraceServeOptions(trace=trace_path, sources=_csv(sources), **kw)
    report = _run_checked(opts, run_trace_serve, "trace-serve")
    click.echo("")
    click.echo(trace_serve_table(report, markdown))
    _emit(report, json_path, None, None)


@bench.command("native")
@click.option("--chunk-size", type=SIZE, default="256KiB", show_default=True,
              help="Bytes of one vLLM CPU-tier chunk (one vLLM block of one worker).")
@click.option("--chunks", default=256, show_default=True, help="Chunks stored and loaded per pass.")
@click.option("--repeats", default=3, show_default=True, help="Passes per tier, interleaved (medians reported).")
@click.option("--tiers", default="kvbm,fs", show_default=True, help="Secondary tiers compared: kvbm, fs.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the fs tier's files and kvbm's disk tier go (a real disk).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--markdown", is_flag=True, help="Print the table as markdown.")
def native_cmd(chunk_size: int, chunks: int, repeats: int, tiers: str, workdir: str | None, json_path: str | None,
               markdown: bool) -> None:
    """kvbm's tier against vLLM's own fs tier under vLLM's TieringOffloadingManager (CPU primary tier)."""
    from kvbm.bench.nativecmp import NativeOptions, native_table, run_native

    names = _csv(tiers)
    if not names or set(names) - {"kvbm", "fs"}:
        raise click.BadParameter(f"--tiers: kvbm and/or fs, got {tiers!r}")
    if chunks < 1 or repeats < 1:
        raise click.BadParameter("--chunks and --repeats must be >= 1")
    opts = NativeOptions(chunk_bytes=chunk_size, chunks=chunks, repeats=repeats,
                         workdir=workdir, tiers=names)
    report = run_native(opts, click.echo)
    click.echo("")
    click.echo(native_table(report, markdown))
    _emit(report, json_path, None, None)


@bench.command("outage")
@click.option("--prompt-words", default=3000, show_default=True, help="Words (tokens) of each new prompt.")
@click.option("--decode-tokens", default=6000, show_default=True, help="At most (cut off after each phase).")
@click.option("--arrivals", default=2, show_default=True, help="New requests sent at once in a prefill phase.")
@click.option("--seed", default=0, show_default=True)
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="Keep the model, logs and daemon files here (else a temporary dir).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def outage_cmd(prompt_words: int, decode_tokens: int, arrivals: int, seed: int, root: str | None,
               json_path: str | None) -> None:
    """The daemon SIGKILLed or SIGSTOPped under vLLM's OpenAI server: decode gaps, TTFTs, the hooks' step times."""
    import json
    import tempfile
    from pathlib import Path

    from kvbm.bench.outage import run

    with tempfile.TemporaryDirectory(prefix="kvbm-outage-") as tmp:
        report = asyncio.run(run(Path(root or tmp), prompt_words, decode_tokens, arrivals, seed))
    text = json.dumps(report, indent=1)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    for name, ph in report["phases"].items():
        worst = max((v["steps"]["slowest_bucket_le_ms"] or 0 for v in ph["hook_times"].values()
                     if v["steps"]["slowest_bucket_le_ms"] != "inf"), default=0)
        click.echo(f"{name:14} decode gap before {ph['decode_max_gap_before_s'] or 0:.3f}s during "
                   f"{ph['decode_max_gap_during_s'] or 0:.3f}s  slowest kvbm step <= {worst} ms  "
                   f"new TTFT {[round(t, 2) for t in ph['new_concurrent_ttft_s'] + ph['new_after_ttft_s']]}")
bench.add_command(__import__("kvbm.cli.bench_verify", fromlist=["verify_cmd"]).verify_cmd)  # kvbm.verify
