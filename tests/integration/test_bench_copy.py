"""Smoke test of ``kvbm bench copy``: tiny sizes; every figure is there, the copies are byte-exact and the connector's
stage counters saw every byte. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvbm.cli.bench import bench


def test_bench_copy_smoke(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    res = CliRunner().invoke(bench, ["copy", "--layers", "2", "--kv-heads", "2", "--head-size", "16", "--block-size",
                                     "32", "--k", "4", "--blocks", "3", "--repeats", "2", "--json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["vblock_bytes"] == 2 * 2 * 32 * 2 * 16 * 4 and r["block_bytes"] == 4 * r["vblock_bytes"]
    assert set(r["orders"]) == {"runs", "scattered"} and r["machine"]["cpu_count"] >= 1
    for order in r["orders"].values():
        assert order["byte_exact"], order
        assert order["stage_copy_in_bytes"] == order["expected_copy_in_bytes"] == 3 * 3 * r["block_bytes"], order
        assert order["load_gbps"] > 0 and order["memcpy_gbps"] > 0 and len(order["gbps_per_repeat"]["load"]) == 2
    assert "load_at_least_80pct_of_memcpy" in r["goals"] and "load/memcpy" in res.output
