"""``kvbm bench verify``: a campaign of seeded schedules through vLLM's real engine (CPU build) and a real daemon,
each checked against a clean engine (kvbm.verify). Replay a failure with ``--seed-list`` and its seed."""

from __future__ import annotations

import sys
from typing import Any

import click


@click.command("verify")
@click.option("--seeds", default=20, show_default=True, help="How many seeds, from --first-seed on.")
@click.option("--first-seed", default=0, show_default=True)
@click.option("--seed-list", default=None, help="Exactly these seeds (comma-separated), e.g. to replay a failure.")
@click.option("--no-faults", is_flag=True, help="Leave out the daemon's SIGSTOP/SIGKILL/restart.")
@click.option("--models", default="llama,gemma2", show_default=True,
              help="Models the seeds take in turn: llama (one KV-cache group), gemma2 (sliding window + full).")
@click.option("--max-minutes", type=float, default=None, help="Start no new seed after this long.")
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="Keep the model, logs and each engine's files here (else a temporary dir).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def verify_cmd(seeds: int, first_seed: int, seed_list: str | None, no_faults: bool, models: str,
               max_minutes: float | None, root: str | None, json_path: str | None) -> None:
    """Random engine schedules (preemption, aborts, resets, pauses, daemon faults) with every stored block, every
    completion after a hit and every hook time checked; exits 1 if any invariant was violated."""
    import tempfile
    from pathlib import Path

    from kvbm.bench.common import write_json
    from kvbm.verify.campaign import run_campaign
    from kvbm.verify.harness import MODELS

    try:
        chosen = [int(s) for s in seed_list.split(",")] if seed_list else list(range(first_seed, first_seed + seeds))
    except ValueError:
        raise click.BadParameter(f"--seed-list: comma-separated integers, got {seed_list!r}") from None
    families = tuple(m.strip() for m in models.split(",") if m.strip())
    if not families or any(m not in MODELS for m in families):
        raise click.BadParameter(f"--models: comma-separated, of {', '.join(MODELS)}; got {models!r}")
    with tempfile.TemporaryDirectory(prefix="kvbm-verify-") as tmp:
        report = run_campaign(chosen, Path(root or tmp), faults=not no_faults, models=families, echo=click.echo,
                              deadline_s=None if max_minutes is None else max_minutes * 60)
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("verify"):]] if "verify" in sys.argv else sys.argv
    bad = {k: v for k, v in report["violations"].items() if v["count"]}
    click.echo(f"{report['schedules']} schedules, {report['blocks_checked']} blocks checked, "
               f"{report['hit_requests']} requests after a kvbm hit, blocks stored "
               f"{report['blocks_stored_share']}, hook max {report['hook_step_max_ms_beyond_sync_loads']} ms "
               f"(copies left out; with them, a sync load's step up to {report['sync_load_max_ms']} ms, a sync "
               f"save's up to {report['sync_save_max_ms']} ms)")
    for name, v in bad.items():
        click.echo(f"  {name}: {v['count']} (seeds {v['seeds']})")
    if report["harness_errors"]:  # not the connector's: the seeds did not run (named, so a campaign is not short)
        click.echo(f"  harness errors (seeds not run): {[e['seed'] for e in report['harness_errors']]}")
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")
    if bad:
        sys.exit(1)


@click.command("hit-numerics")
@click.option("--prompts", default=50, show_default=True, help="Random prompts of 600-1,500 tokens.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"]))
@click.option("--layers", default=8, show_default=True, help="Layers of the tiny random Llama.")
@click.option("--seed", default=0, show_default=True)
@click.option("--root", type=click.Path(file_okay=False), default=None, help="Keep the model and logs here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def hit_numerics_cmd(prompts: int, dtype: str, layers: int, seed: int, root: str | None,
                     json_path: str | None) -> None:
    """Each prompt computed whole, then from vLLM's own prefix cache, then from kvbm (vLLM's cache reset): how
    often each hit's greedy tokens differ from the full compute (the hit's numerics), and whether kvbm's hit ever
    differs from vLLM's own hit of the same tokens (exits 1 if so: that would be kvbm's doing)."""
    import platform
    import tempfile
    from pathlib import Path

    from kvbm.bench.common import write_json
    from kvbm.bench.openai_server import bf16_arithmetic
    from kvbm.verify.numerics import run

    with tempfile.TemporaryDirectory(prefix="kvbm-numerics-") as tmp:
        report = run(Path(root or tmp), prompts=prompts, dtype=dtype, seed=seed, layers=layers)
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "bf16": bf16_arithmetic()}
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("hit-numerics"):]] \
        if "hit-numerics" in sys.argv else sys.argv
    click.echo(f"{report['prompts']} prompts ({dtype}): vLLM's own hit differs from the full compute in "
               f"{report['own_hit_differs_from_full']}, kvbm's hit in {report['kvbm_hit_differs_from_full']}; "
               f"kvbm's hit differs from vLLM's own in {report['kvbm_hit_differs_from_own_hit']} "
               f"(same cached tokens in {report['same_cached_tokens']})")
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")
    if report["kvbm_hit_differs_from_own_hit"]:
        sys.exit(1)


@click.command("conversations")
@click.option("--conversations", default=6, show_default=True)
@click.option("--prompt-tokens", default=1500, show_default=True)
@click.option("--answer-tokens", default=2500, show_default=True, help="Turn 1 decodes this many tokens each.")
@click.option("--gpu-blocks", default=110, show_default=True, help="vLLM's KV cache in 128-token blocks (preempts).")
@click.option("--layers", default=8, show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]))
@click.option("--seed", default=0, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None, help="Keep the model and logs here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def conversations_cmd(workdir: str | None, json_path: str | None, **kw: Any) -> None:
    """Conversations decoding at once under preemption through vLLM's OpenAI server, then each next turn from kvbm
    (vLLM's cache reset) against the same turn computed (the connector reset too); exits 1 unless every next turn
    hit kvbm and answered the computed tokens."""
    import tempfile
    from pathlib import Path

    from kvbm.bench.common import write_json
    from kvbm.bench.openai_server import bf16_arithmetic
    from kvbm.verify.conversations import ConversationOptions, run

    with tempfile.TemporaryDirectory(prefix="kvbm-conv-") as tmp:
        report = run(Path(workdir or tmp), ConversationOptions(**kw))
    report["machine"] = {"bf16": bf16_arithmetic()}
    click.echo(f"{report['next_turns']} next turns after {report['preemptions']:.0f} preemptions: "
               f"{report['served_by_kvbm']} served by kvbm ({report['cached_tokens_total']} cached tokens), "
               f"{report['same_as_computed']} answered as computed")
    for r in report["rows"]:
        if not r["same"]:
            click.echo(f"  conversation {r['conversation']}: {r['detail']}")
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")
    if not report["ok"]:
        sys.exit(1)


COMMANDS = [verify_cmd, hit_numerics_cmd, conversations_cmd]
