"""Fixed seeds of the chaos harness (kvbm.chaos) against a real ``kvbm serve``, SeaweedFS behind the fault proxy,
and G3 on a size-limited tmpfs: every invariant holds over them, and a seed replays.

The invariants that today's code breaks (issue 37, section 2) are marked xfail with the item and the seed that
shows it; ``strict``, so the test fails as soon as the fix lands and the marker must go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from needs import require

from kvbm.chaos.invariants import INVARIANTS
from kvbm.chaos.runner import Harness, S3Target, campaign, tmpfs_available
from kvbm.chaos.schedule import Op, Schedule, plan

pytestmark = pytest.mark.s3

# Chosen so that together they inject every kind of fault below (checked), in a few seconds each here.
SEEDS = [32, 104, 102, 105, 108]
FAULT_KINDS = {"sigkill", "sigstop", "restart", "disk_full", "journal_delete", "s3_outage", "fuzz_random",
               "fuzz_truncated", "fuzz_out_of_range", "fuzz_oversized", "raw_stream", "events_subscriptions",
               "flood_requests", "register_storm"}
# invariant -> why it fails today, and the seeds that show it. None open: D1's and D2's seeds pass since their fixes,
# seed 104's daemon_alive (a G3 directory it cannot write) since the daemon serves with G3 off.
OPEN: dict[str, str] = {}


def _target(srv) -> S3Target:
    return S3Target(srv.endpoint, srv.bucket, srv.access_key, srv.secret_key)


@pytest.fixture(scope="module")
def report(s3_server, tmp_path_factory) -> dict:
    require("tmpfs", *tmpfs_available())  # G3 on a size-limited filesystem: the disk faults
    return campaign(SEEDS, _target(s3_server), tmp_path_factory.mktemp("chaos"))


def test_the_fixed_seeds_inject_every_kind_of_fault(report: dict) -> None:
    assert report["schedules"] == len(SEEDS)
    assert not report["harness_errors"], report["harness_errors"][:3]
    assert set(report["faults"]) >= FAULT_KINDS, FAULT_KINDS - set(report["faults"])
    assert {"store", "load", "lookup", "purge", "register", "cross_access", "cross_register"} <= set(report["ops"])


@pytest.mark.parametrize("invariant", [
    pytest.param(inv, marks=pytest.mark.xfail(strict=True, reason=OPEN[inv])) if inv in OPEN else inv
    for inv in INVARIANTS])
def test_every_invariant_holds_over_the_fixed_seeds(report: dict, invariant: str) -> None:
    found = [f"seed {r['seed']} step {v['step']}: {v['detail'][:300]}" for r in report["runs"] for v in r["violations"]
             if v["invariant"] == invariant]
    assert not found, "\n".join(found[:5])


def test_a_seed_replays_through_kvbm_bench_chaos(s3_server, tmp_path: Path) -> None:
    """``kvbm bench chaos --seed S`` twice: the same schedule both times (the plan of S), and every violation the
    report lists is filed under its invariant with that seed, so a campaign's seed is all a replay needs."""
    seed, steps = 5, 8
    runs = []
    tmp_path = tmp_path / ("w" * 90)  # a work dir too deep for the daemon's unix sockets: they go elsewhere
    tmp_path.mkdir()
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
        env |= {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
        proc = subprocess.run([sys.executable, "-m", "kvbm.cli.main", "bench", "chaos", "--seed", str(seed),
                               "--steps", str(steps), "--s3-endpoint", s3_server.endpoint, "--s3-bucket",
                               s3_server.bucket, "--workdir", str(tmp_path), "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs.append(json.loads(out.read_text()))
    want = [op.as_dict() for op in plan(seed, steps).ops]
    assert [r["runs"][0]["trace"] for r in runs] == [want, want]
    for r in runs:
        assert r["options"]["seeds"] == [seed] and r["schedules"] == 1
        for v in r["runs"][0]["violations"]:
            assert seed in r["violations"][v["invariant"]]["seeds"]
    # The deterministic findings (a Register let in or not, a refusal's name) are the same on both runs.
    same = {"cross_tenant", "unnamed_refusal"}
    assert [{v["invariant"] for v in r["runs"][0]["violations"]} & same for r in runs].count(
        {v["invariant"] for v in runs[0]["runs"][0]["violations"]} & same) == 2


def test_a_purge_refused_mid_outage_leaves_its_blocks_undetermined_not_acked(s3_server, tmp_path: Path) -> None:
    """Seed 4000's acked_lost, directed: a block acked durable while S3 is out (owed), then purged while S3 is
    still out. The daemon drops the owed write (a purge must not come back when S3 does) and answers
    ``unavailable`` (the bucket delete failed). Whether the block is in the bucket afterwards is not known to the
    client, so the model may expect it neither there nor gone: the end check must find no violation."""
    require("tmpfs", *tmpfs_available())
    sched = Schedule(seed=4000, index_bucket="background", final="kill", ops=[
        Op("s3_outage", seconds=600.0),  # until the end heals it: a loaded machine's store can outlast a short one
        Op("store", "a", 1, [12, 13], durable=True),
        Op("purge", "a", 0, [12]),
    ])
    h = Harness(sched, _target(s3_server), tmp_path)
    res = h.run()
    assert not res.harness_errors, res.harness_errors
    assert res.refusals.get("unavailable") == 1, (res.refusals, res.trace)  # the purge failed, as seed 4000's
    assert not res.violations, res.violations
    a12 = h.world.keys("a", [12])[0]
    assert a12 not in h.model.durable and a12 not in h.model.purged and a12 in h.model.undetermined


def test_seed_4052s_interleaving_loses_no_acked_block(s3_server, tmp_path: Path) -> None:
    """Seed 4052's one-off acked_lost, directed (it never replayed): tenant c's blocks acked durable while S3 is out
    (owed), the journal deleted under the daemon, another block acked (its owed line goes to the journal written
    again), SIGKILL right after that ack (inside the journal's debounce), a lazy start while S3 is still out, then
    S3 back, a final SIGKILL and a lazy start again: every acked block is in the bucket."""
    require("tmpfs", *tmpfs_available())
    sched = Schedule(seed=4052, index_bucket="lazy", final="kill", ops=[
        Op("s3_outage", seconds=600.0),  # until the end heals it (before the final SIGKILL)
        Op("store", "c", 1, [6, 7, 8], durable=True),
        Op("journal_delete"),
        Op("store", "c", 1, [22], durable=True),
        Op("kill"),
        Op("store", "c", 0, [9], durable=True),
    ])
    h = Harness(sched, _target(s3_server), tmp_path)
    res = h.run()
    assert not res.harness_errors, res.harness_errors
    assert res.faults.get("journal_delete") == 1 and res.faults.get("sigkill") == 2, res.faults
    assert len(h.model.durable) == 5, (res.refusals, res.trace)  # all acked durable on G3 during the outage
    assert not res.violations, res.violations


def test_a_purge_while_the_blocks_write_through_is_in_flight_is_not_undone(s3_server, tmp_path: Path) -> None:
    """Seed 6004's purge_undone, directed: tenant b stores a block (not durable: the ack does not wait for S3) while
    every S3 request is delayed 1-1.5 s, and purges it at once; its write-through PUT is still in flight when the
    Evict runs. The block must not be in the bucket at the end (issue 37: the PUT landed after the Evict was answered;
    now the purge covers the move, which deletes its copy when it lands, kvbm.manager.purges)."""
    require("tmpfs", *tmpfs_available())
    sched = Schedule(seed=6004, index_bucket="start", final="", ops=[
        Op("register", "b", 0),
        Op("s3_faults", count=3, rates={"latency": 1.0, "latency_s": (1.0, 1.5)}),  # type: ignore[dict-item]
        Op("store", "b", 0, [13]),
        Op("purge", "b", 0, [13]),
    ])
    h = Harness(sched, _target(s3_server), tmp_path)
    res = h.run()
    assert not res.harness_errors, res.harness_errors
    assert h.world.keys("b", [13])[0] in h.model.purged, (res.refusals, res.trace)  # the Evict was answered
    assert not res.violations, res.violations
