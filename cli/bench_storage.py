"""``kvbm bench tiers | manager | fleet | native``: the storage paths, the manager, the fleet, vLLM's native
offload tier."""

from __future__ import annotations

import asyncio

import click

from kvbm.cli.bench_common import csv_list, emit, with_output, with_target, workdir_option
from kvbm.cli.common import SIZE


@click.command("tiers")
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
@with_target()
@with_output(json_help="Write the report here.", plot="Draw a PNG here.")
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
        block_bytes=block_size, blocks=blocks, repeats=repeats, groups=csv_list(groups),
        s3_clients=csv_list(s3_clients), file_io=csv_list(file_io), disk_modes=csv_list(disk_modes),
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
    emit(report, json_path, plot_path, plot_tiers)
    if report.get("peer_error"):
        raise click.ClickException(report["peer_error"])


@click.command("manager")
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
@with_target()
@with_output()
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
        onboard_repeats=repeats, groups=csv_list(groups), workdir=workdir, s3_endpoint=s3_endpoint,
        s3_access_key=s3_access_key, s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
    )
    report = asyncio.run(run_manager(opts, click.echo))
    click.echo("")
    click.echo(manager_table(report, markdown))
    emit(report, json_path, None, None)


@click.command("fleet")
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
@click.option("--groups", default="fleet,listing", show_default=True, help="Of fleet, listing, fanout, route.")
@click.option("--fanout-daemons", default=8, show_default=True, help="fanout: daemons that discover each other.")
@click.option("--rounds", default=16, show_default=True, help="fanout: blocks stored (each by the next daemon).")
@click.option("--modes", default="events,probe", show_default=True, help="fanout: events (discovery), probe.")
@click.option("--negative-ttl", default=1.0, show_default=True, help="fanout: daemon.probe_negative_ttl_s.")
@click.option("--cluster", is_flag=True, help="Run on a fresh SeaweedFS cluster (3 volume servers, 001, 2 gateways).")
@click.option("--kill-volume", is_flag=True, help="With --cluster: kill a volume server halfway (fanout, events).")
@click.option("--route", type=click.Choice(["prefix"]), default=None,
              help="Route requests on kvbm's router events vs at random, two nodes (the route group; alone unless "
                   "--groups is given).")
@click.option("--route-requests", default=200, show_default=True, help="route: requests sent (seeded).")
@with_target("Where temp dirs go.")
@with_output()
def fleet_cmd(daemons: int, blocks: int, hit_timeout: float, lookups: int, block_size: int, listing_sizes: str,
              listing_prefix: str, put_concurrency: int, list_concurrency: int, groups: str, fanout_daemons: int,
              rounds: int, modes: str, negative_ttl: float, cluster: bool, kill_volume: bool, route: str | None,
              route_requests: int, workdir: str | None,
              s3_endpoint: str | None, s3_access_key: str, s3_secret_key: str, s3_bucket: str,
              json_path: str | None, markdown: bool) -> None:
    """N daemons on one bucket: A's durable ack to B's hit, lookup cost, and listing 100k/1M block objects."""
    from kvbm.bench.fleet import FleetOptions, fleet_table, run_fleet

    if daemons < 2 or blocks < 1 or lookups < 1 or fanout_daemons < 2 or rounds < 1:
        raise click.BadParameter("--daemons and --fanout-daemons must be >= 2, --blocks, --lookups, --rounds >= 1")
    bad = [m for m in csv_list(modes) if m not in ("events", "probe")]
    if bad or (kill_volume and not cluster) or (cluster and s3_endpoint):
        raise click.BadParameter(f"--modes: events/probe, not {bad}" if bad else
                                 "--kill-volume needs --cluster" if kill_volume and not cluster else
                                 "--cluster starts its own store: no --s3-endpoint")
    if route and click.get_current_context().get_parameter_source("groups") == click.core.ParameterSource.DEFAULT:
        groups = "route"
    elif route and "route" not in csv_list(groups):
        groups += ",route"
    opts = FleetOptions(
        route_requests=route_requests,
        daemons=daemons, blocks=blocks, hit_timeout_s=hit_timeout, lookups=lookups,
        block_bytes=block_size,
        listing_sizes=tuple(int(x) for x in csv_list(listing_sizes)), listing_prefix=listing_prefix.strip("/"),
        put_concurrency=put_concurrency, list_concurrency=list_concurrency, groups=csv_list(groups), workdir=workdir,
        fanout_daemons=fanout_daemons, fanout_rounds=rounds, fanout_modes=csv_list(modes), negative_ttl_s=negative_ttl,
        cluster=cluster, kill_volume=kill_volume, s3_endpoint=s3_endpoint, s3_access_key=s3_access_key,
        s3_secret_key=s3_secret_key, s3_bucket=s3_bucket,
    )
    report = asyncio.run(run_fleet(opts, click.echo))
    click.echo("")
    click.echo(fleet_table(report, markdown))
    emit(report, json_path, None, None)


@click.command("native")
@click.option("--chunk-size", type=SIZE, default="256KiB", show_default=True,
              help="Bytes of one vLLM CPU-tier chunk (one vLLM block of one worker).")
@click.option("--chunks", default=256, show_default=True, help="Chunks stored and loaded per pass.")
@click.option("--repeats", default=3, show_default=True, help="Passes per tier, interleaved (medians reported).")
@click.option("--tiers", default="kvbm,fs", show_default=True, help="Secondary tiers compared: kvbm, fs.")
@workdir_option("Where the fs tier's files and kvbm's disk tier go (a real disk).")
@with_output()
def native_cmd(chunk_size: int, chunks: int, repeats: int, tiers: str, workdir: str | None, json_path: str | None,
               markdown: bool) -> None:
    """kvbm's tier against vLLM's own fs tier under vLLM's TieringOffloadingManager (CPU primary tier)."""
    from kvbm.bench.nativecmp import NativeOptions, native_table, run_native

    names = csv_list(tiers)
    if not names or set(names) - {"kvbm", "fs"}:
        raise click.BadParameter(f"--tiers: kvbm and/or fs, got {tiers!r}")
    if chunks < 1 or repeats < 1:
        raise click.BadParameter("--chunks and --repeats must be >= 1")
    opts = NativeOptions(chunk_bytes=chunk_size, chunks=chunks, repeats=repeats,
                         workdir=workdir, tiers=names)
    report = run_native(opts, click.echo)
    click.echo("")
    click.echo(native_table(report, markdown))
    emit(report, json_path, None, None)


COMMANDS = [tiers_cmd, manager_cmd, fleet_cmd, native_cmd]
