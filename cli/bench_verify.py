"""``kvbm bench verify``: a campaign of seeded schedules through vLLM's real engine (CPU build) and a real daemon,
each checked against a clean engine (kvbm.verify). Replay a failure with ``--seed-list`` and its seed."""

from __future__ import annotations

import sys

import click


@click.command("verify")
@click.option("--seeds", default=20, show_default=True, help="How many seeds, from --first-seed on.")
@click.option("--first-seed", default=0, show_default=True)
@click.option("--seed-list", default=None, help="Exactly these seeds (comma-separated), e.g. to replay a failure.")
@click.option("--no-faults", is_flag=True, help="Leave out the daemon's SIGSTOP/SIGKILL/restart.")
@click.option("--max-minutes", type=float, default=None, help="Start no new seed after this long.")
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="Keep the model, logs and each engine's files here (else a temporary dir).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def verify_cmd(seeds: int, first_seed: int, seed_list: str | None, no_faults: bool, max_minutes: float | None,
               root: str | None, json_path: str | None) -> None:
    """Random engine schedules (preemption, aborts, resets, pauses, daemon faults) with every stored block, every
    completion after a hit and every hook time checked; exits 1 if any invariant was violated."""
    import tempfile
    from pathlib import Path

    from kvbm.bench.common import write_json
    from kvbm.verify.campaign import run_campaign

    try:
        chosen = [int(s) for s in seed_list.split(",")] if seed_list else list(range(first_seed, first_seed + seeds))
    except ValueError:
        raise click.BadParameter(f"--seed-list: comma-separated integers, got {seed_list!r}") from None
    with tempfile.TemporaryDirectory(prefix="kvbm-verify-") as tmp:
        report = run_campaign(chosen, Path(root or tmp), faults=not no_faults, echo=click.echo,
                              deadline_s=None if max_minutes is None else max_minutes * 60)
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("verify"):]] if "verify" in sys.argv else sys.argv
    bad = {k: v for k, v in report["violations"].items() if v["count"]}
    click.echo(f"{report['schedules']} schedules, {report['blocks_checked']} blocks checked, "
               f"{report['hit_requests']} requests after a kvbm hit, blocks stored "
               f"{report['blocks_stored_share']}, hook max {report['hook_step_max_ms_beyond_sync_loads']} ms")
    for name, v in bad.items():
        click.echo(f"  {name}: {v['count']} (seeds {v['seeds']})")
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")
    if bad:
        sys.exit(1)


COMMANDS = [verify_cmd]
