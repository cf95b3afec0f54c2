"""``kvbm bench chaos``: a fault-injection and fuzzing campaign against ``kvbm serve`` (:mod:`kvbm.chaos`).

Each seed is one schedule (stores, loads, lookups, purges and registers of three tenants, with S3 faults
through a loopback fault proxy, SIGKILL/SIGSTOP, a full or read-only G3 filesystem, a deleted owed journal and
hostile frames); the report counts operations and faults by kind and violations by invariant, with the seeds
that replay them (``--seed S``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kvbm.cli.bench_common import s3_options, workdir_option


@click.command("chaos")
@click.option("--seeds", "count", default=20, show_default=True, help="Schedules to run (seeds FIRST..FIRST+N-1).")
@click.option("--first", default=0, show_default=True, help="The first seed.")
@click.option("--seed", "only", type=int, multiple=True, help="Replay exactly these seeds (repeatable).")
@click.option("--steps", default=28, show_default=True, help="Steps per schedule.")
@s3_options(bucket="kvbm-chaos", bucket_help=None)
@workdir_option("Where the daemons' directories go (a temporary dir by default).")
@click.option("--max-minutes", default=0.0, show_default=True,
              help="Start no schedule after this long (0: run every seed); the JSON is rewritten after each one.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def chaos_cmd(count: int, first: int, only: tuple[int, ...], steps: int, s3_endpoint: str | None,
              s3_access_key: str, s3_secret_key: str, s3_bucket: str, workdir: str | None, max_minutes: float,
              json_path: str | None) -> None:
    """Seeded fault-injection schedules against a real daemon; violations by invariant, with their seeds."""
    from kvbm.bench.common import machine, s3_server, temp_dir, write_json
    from kvbm.chaos.runner import S3Target, campaign

    if count < 1 and not only:
        raise click.BadParameter("--seeds must be at least 1")
    seeds = list(only) or list(range(first, first + count))
    options = {"seeds": seeds if only else f"{first}..{first + count - 1}", "steps": steps,
               "s3_endpoint": s3_endpoint or "embedded", "max_minutes": max_minutes}
    command = ["kvbm", "bench", *sys.argv[sys.argv.index("chaos"):]] if "chaos" in sys.argv else sys.argv

    def stamp(report: dict[str, Any]) -> dict[str, Any]:
        report |= {"machine": mach, "options": options, "command": command}
        if json_path:
            write_json(Path(json_path), report)
        return report

    mach = machine()
    with temp_dir("kvbm-chaos-", workdir) as tmp, s3_server(tmp, endpoint=s3_endpoint, access_key=s3_access_key,
                                                            secret_key=s3_secret_key, bucket=s3_bucket) as srv:
        s3 = S3Target(srv["endpoint"], srv["bucket"], srv["access_key"], srv["secret_key"])
        report = stamp(campaign(seeds, s3, tmp, steps=steps, echo=click.echo, max_seconds=max_minutes * 60,
                                progress=stamp))
    bad = {k: v for k, v in report["violations"].items() if v["count"]}
    click.echo(f"{report['schedules']} schedules in {report['seconds']} s; faults: "
               + ", ".join(f"{k} {v}" for k, v in sorted(report["faults"].items())))
    click.echo("violations: " + (", ".join(f"{k} {v['count']} (seeds {v['seeds'][:10]})" for k, v in bad.items())
                                 or "none"))
    if report["harness_errors"]:
        click.echo(f"harness errors: {len(report['harness_errors'])} (first: {report['harness_errors'][0][:300]})")
    if json_path:
        click.echo(f"json: {json_path}")


@click.command("isolation")
@click.option("--repeats", default=5, show_default=True, help="Solo/flooded pairs of timed phases (medians over them).")
@click.option("--iters", default=400, show_default=True, help="Tenant A's lookup+load pairs timed per phase.")
@click.option("--blocks", default=8, show_default=True, help="Tenant A's blocks per lookup+load.")
@click.option("--b-sessions", default=4, show_default=True, help="Tenant B's flooding sessions.")
@click.option("--b-inflight", default=16, show_default=True, help="Tenant B's max_inflight (its flood's depth).")
@click.option("--b-lookups-only", is_flag=True, help="Tenant B floods lookups only (no stores).")
@workdir_option("Where the daemon's directories go (a temporary dir by default).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def isolation_cmd(repeats: int, iters: int, blocks: int, b_sessions: int, b_inflight: int, b_lookups_only: bool,
                  workdir: str | None, json_path: str | None) -> None:
    """Tenant A's lookup+load p99 alone vs while tenant B floods stores and lookups at its caps (ratio, medians)."""
    from kvbm.bench.common import temp_dir, write_json
    from kvbm.chaos.isolation import IsolationOptions, run_isolation

    for name, v in (("--repeats", repeats), ("--iters", iters), ("--blocks", blocks), ("--b-sessions", b_sessions),
                    ("--b-inflight", b_inflight)):
        if v < 1:
            raise click.BadParameter(f"{name} must be at least 1")
    o = IsolationOptions(repeats=repeats, iters=iters, blocks=blocks, b_sessions=b_sessions, b_inflight=b_inflight,
                         b_stores=not b_lookups_only)
    with temp_dir("kvbm-isolation-", workdir) as tmp:
        report = run_isolation(o, tmp, echo=click.echo)
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("isolation"):]] if "isolation" in sys.argv \
        else sys.argv
    m = report["median"]
    click.echo(f"A p99: solo {m['solo']['p99_ms']} ms, B flooding another daemon {m['control']['p99_ms']} ms, B "
               f"flooding A's daemon {m['shared']['p99_ms']} ms: {report['ratio_p99']}x solo (p50 "
               f"{report['ratio_p50']}x), {report['daemon_share_p99']}x the control; load {report['load_avg_end']}")
    if json_path:
        write_json(Path(json_path), report)
        click.echo(f"json: {json_path}")


COMMANDS = [chaos_cmd, isolation_cmd]
