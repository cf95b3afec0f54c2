"""A fixed set of the harness's seeds (kvbm.verify) through vLLM's real engine (CPU build) and a real daemon.

Each seed is a schedule (shared prefixes, conversations, a KV cache that preempts, aborts, prefix-cache resets,
pauses, daemon SIGSTOP/SIGKILL) run by one engine, then replayed request by request on a clean engine; the
invariants are the harness's (kvbm/verify/harness.py). Hook time (invariant 5) is measured, not asserted here: the
suite runs no timed tests; ``kvbm bench verify`` counts it. A seed marked xfail (strict) fails on today's
connector for the bug it names: fixing the bug turns it into an XPASS, which fails until the mark is removed.
"""

from __future__ import annotations

import importlib.util

import pytest
from needs import needs

from kvbm.verify.harness import MODELS, run_seed, write_model

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]
ASSERTED = {"block_kv", "engine_alive", "none_stuck", "tokens_after_hit", "blocks_stored", "stale_after_reset"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verify-models")
    return {m: write_model(root, m) for m in MODELS}


def known(bug: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=bug)


# Sync-load seeds (deterministic: no timing decides which step a load lands in) and one async seed that passes.
SEEDS = [
    pytest.param(2, "llama", id="seed-2-async-load-daemon-killed"),
    pytest.param(13, "llama", id="seed-13-reset-running-and-reset-connector"),  # S3/S4: failed before their fixes
    # E2, seen in-process: vLLM refuses reset_prefix_cache(reset_running_requests=True) (raises) while a finished
    # request's blocks are held for kvbm's last saves or a request waits for its async load; the harness steps the
    # engine and asks again, as a weight sync would, and the reset goes through within steps (was xfail).
    pytest.param(21, "llama", id="seed-21-reset-refused-then-retried"),
    # Seed 5006 (round 15's campaign: a weight sync's pause while requests wait for their async loads) met a loading
    # request on some runs only, and aborted every request it had: a loaded machine's run checked no block at all
    # (round 16's CI). test_verify_directed.py holds that contract now, its pause held back until a load runs.
    # Seed 15 (E2: pause_generation(clear_cache) raised 'Failed to reset KV cache' while kvbm held an aborted
    # request's blocks for its saves) was a strict xfail; with aborted requests' blocks freed at once it keeps every
    # invariant but its pause aborts every request it checks: test_verify_directed.py holds that contract instead.
]


@pytest.mark.parametrize("seed,family", SEEDS)
def test_a_seeded_schedule_keeps_every_invariant(seed, family, models, tmp_path):
    check_seed(seed, family, models, tmp_path)


def check_seed(seed: int, family: str, models: dict[str, str], tmp_path) -> None:
    """Run seed ``seed`` on model ``family`` and assert the invariants the suite holds."""
    report = run_seed(seed, tmp_path, models[family], family=family)
    c = report["counts"]
    print(f"seed {seed}: {report['ops']}, {c}, {report['preemptions']} preemptions, events {report['events']}")
    assert c["blocks_checked"] > 0, "no block was stored: the schedule checked nothing"
    broken = [v for v in report["violations"] if v["invariant"] in ASSERTED]
    assert not broken, f"seed {seed} (replay: kvbm bench verify --seed-list {seed} --models {family}): {broken}"
