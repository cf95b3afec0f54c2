"""The verify harness tells its own failures from the connector's: a seed whose harness daemon could not start
ran no engine, so it is a harness error (run again, then named), never an ``engine_alive`` violation (the r11
campaign counted seeds 1107 and 1108 so: their daemons did not start within 60 s on a starved machine)."""

from __future__ import annotations

from kvbm.verify.campaign import run_campaign


def test_a_campaign_names_its_harness_errors_apart_from_the_schedules_it_ran(tmp_path):
    # The seed's harness daemon cannot start, twice: a file stands where its work dir goes.
    for attempt in range(2):
        (tmp_path / "seed-5-llama" / f"try-{attempt}").mkdir(parents=True)
        (tmp_path / "seed-5-llama" / f"try-{attempt}" / "pressure").write_text("not a directory")
    report = run_campaign([5], tmp_path, models=("llama",), echo=lambda _: None)
    assert report["schedules"] == 0, report
    assert [e["seed"] for e in report["harness_errors"]] == [5], report["harness_errors"]
    assert "pressure" in report["harness_errors"][0]["detail"], report["harness_errors"]
    assert all(v["count"] == 0 for v in report["violations"].values()), report["violations"]  # was engine_alive
