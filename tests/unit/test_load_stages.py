"""The load path's stage counters through the hook times: in each side's snapshot and JSON file (written after the
step a load ran in, not a second later), per interval in vLLM's connector stats, reduced to GB/s and tiers."""

from __future__ import annotations

import json

from needs import import_or_skip

import_or_skip("vllm", "vllm", "the vLLM CPU build is not installed (KVBM_EXTRAS=vllm)")


def test_a_steps_stages_are_in_the_file_once_the_step_ends(tmp_path, monkeypatch):
    from kvbm.integrations.vllm import hooks
    from kvbm.integrations.vllm.stages import Stages

    monkeypatch.setenv("KVBM_HOOK_TIMES_DIR", str(tmp_path))
    st = Stages()
    t = hooks.HookTimes("worker", 1e6, stages=st)
    t.end_step()  # the first step writes the file
    st.add(copy_in_bytes=1000, copy_in_s=0.5, copy_in_vblocks=2)
    t.end_step()  # within a second of the last write: written anyway, the stages moved
    (f,) = tmp_path.glob("worker-*.json")
    assert json.loads(f.read_text())["stages"] == {"copy_in_bytes": 1000, "copy_in_s": 0.5, "copy_in_vblocks": 2}


def test_vllms_connector_stats_carry_each_intervals_stages_of_every_worker():
    from kvbm.integrations.vllm import hooks
    from kvbm.integrations.vllm.stages import Stages

    sa, sb = Stages(), Stages()
    a, b = hooks.HookTimes("worker", 1e6, stages=sa), hooks.HookTimes("worker", 1e6, stages=sb)
    sa.add(copy_in_bytes=3e9, copy_in_s=1.0)
    sa.onboarded(4.0, ["G2", "G2", "G3"])
    sb.add(copy_in_bytes=1e9, copy_in_s=1.0, computed_after_hit_tokens=17)
    sb.onboarded(2.0, ["G4"])
    stats = hooks.KvbmConnectorStats(data=a.take_interval())
    stats.aggregate(hooks.KvbmConnectorStats(data=b.take_interval()))
    r = stats.reduce()
    assert r["kvbm copy in gbps"] == 2.0 and r["kvbm onboard ms mean"] == 3.0
    assert (r["kvbm onboard blocks G2"], r["kvbm onboard blocks G3"], r["kvbm onboard blocks G4"]) == (2, 1, 1)
    assert r["kvbm onboard blocks"] == 4 and r["kvbm computed after hit tokens"] == 17
    assert not stats.is_empty()
    assert a.take_interval() == {}  # an interval's stages are reported once
    sa.add(copy_in_bytes=5)
    assert a.take_interval()["stages"] == {"copy_in_bytes": 5}
