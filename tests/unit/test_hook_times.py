"""The connector's hook times: histograms per hook and per step, the warning line, vLLM's connector stats, the
JSON files ``KVBM_HOOK_TIMES_DIR`` asks for, and the outage bench's per-phase view of them."""

from __future__ import annotations

import json
import logging
import time

from needs import import_or_skip

import_or_skip("vllm", "vllm", "the vLLM CPU build is not installed (KVBM_EXTRAS=vllm)")


def test_a_step_past_the_threshold_is_counted_logged_and_written(tmp_path, monkeypatch, caplog):
    from kvbm.integrations.vllm import hooks

    monkeypatch.setenv("KVBM_HOOK_TIMES_DIR", str(tmp_path))
    t = hooks.HookTimes("worker", warn_ms=5.0)
    t.end_step()  # a step whose hooks took nothing
    with caplog.at_level(logging.WARNING, logger="kvbm.vllm"):
        with t.time("handle_preemptions"):
            time.sleep(0.02)
        t.end_step()
    snap = t.snapshot()
    assert snap["step"]["count"] == 2 and snap["slow_steps"] == 1
    h = snap["hooks"]["handle_preemptions"]
    assert h["count"] == 1 and h["max_ms"] >= 20 and sum(h["buckets"]) == 1
    assert sum(h["buckets"][hooks.BOUNDS_MS.index(25.0):]) == 1  # in a bucket above 20 ms (a loaded machine: any)
    assert "held an engine step" in caplog.text and "handle_preemptions" in caplog.text
    t.dump()
    (f,) = tmp_path.glob("worker-*.json")
    assert json.loads(f.read_text())["hooks"]["handle_preemptions"]["count"] == 1


def test_vllms_connector_stats_aggregate_intervals_of_every_worker():
    from kvbm.integrations.vllm import hooks

    a, b = hooks.HookTimes("worker", 1e6), hooks.HookTimes("worker", 5.0)  # a: never slow; b: its 30 ms step is
    for t, ms in ((a, 0.0), (b, 0.03)):
        with t.time("wait_for_save"):
            time.sleep(ms)
        t.end_step()
    stats = hooks.KvbmConnectorStats(data=a.take_interval())
    stats.aggregate(hooks.KvbmConnectorStats(data=b.take_interval()))
    assert stats.data["hooks"]["wait_for_save"]["count"] == 2 and stats.data["slow_steps"] == 1
    assert stats.reduce()["kvbm wait_for_save max ms"] >= 30
    assert a.take_interval() == {}  # an interval is reported once
    assert not stats.is_empty() and hooks.KvbmConnectorStats().is_empty()


def test_the_outage_bench_reads_each_phases_steps_from_the_files():
    from kvbm.bench.outage import hook_delta
    from kvbm.integrations.vllm import hooks

    t = hooks.HookTimes("scheduler", 5.0)
    with t.time("build_connector_meta"):
        pass
    t.end_step()
    before = {"scheduler-1": t.snapshot()}
    with t.time("build_connector_meta"):
        time.sleep(0.012)
    t.end_step()
    d = hook_delta(before, {"scheduler-1": t.snapshot()})["scheduler"]
    assert d["steps"]["count"] == 1 and d["slow_steps"] == 1
    assert d["hooks"]["build_connector_meta"]["slowest_bucket_le_ms"] >= 25.0
