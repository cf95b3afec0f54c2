"""``kvbm bench tiers --peer-python``: LMCache's S3 connector runs against the bench's own SeaweedFS and its
rows sit next to kvbm's. The real peer needs LMCache in its own venv (scripts/lmcache_venv.sh), named by
KVBM_BENCH_PEER_PYTHON; without it that test is skipped, naming lmcache."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from needs import skip

from kvbm.cli.bench import bench

pytestmark = pytest.mark.s3

TINY = ["tiers", "--groups", "s3", "--s3-clients", "aiobotocore", "--no-s3-reference", "--block-size", "256KiB",
        "--blocks", "4", "--repeats", "1"]


def test_peer_python_without_lmcache_fails_naming_it(tmp_path: Path) -> None:
    # kvbm's own venv has no lmcache (its numpy pin clashes): the bench must say so and exit non-zero,
    # after the kvbm rows, with the JSON still written.
    out = tmp_path / "tiers.json"
    res = CliRunner().invoke(bench, [*TINY, "--workdir", str(tmp_path), "--json", str(out),
                                     "--peer-python", sys.executable])
    assert res.exit_code != 0, res.output
    assert "lmcache: not installed" in res.output
    rep = json.loads(out.read_text())
    assert "lmcache" in rep["peer_error"]
    assert any(r["path"] == "G4->G2 GET" and "S3Tier" in r["kvbm"] for r in rep["rows"])
    assert not any(r.get("peer") for r in rep["rows"])


def test_peer_lmcache_rows_next_to_kvbm(tmp_path: Path) -> None:
    peer = os.environ.get("KVBM_BENCH_PEER_PYTHON")
    if not peer:
        skip("lmcache", "no peer python (set KVBM_BENCH_PEER_PYTHON; scripts/lmcache_venv.sh builds one)")
    out = tmp_path / "tiers.json"
    # Named relative to the working directory, as in `--peer-python .venv-lmcache/bin/python`: the peer must
    # still start although it runs from its own temp dir.
    rel = os.path.relpath(peer)
    assert not os.path.isabs(rel)
    res = CliRunner().invoke(bench, [*TINY, "--workdir", str(tmp_path), "--json", str(out), "--peer-python", rel],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["paths"]["peer"]["component"] == "lmcache"
    peer_rows = {r["path"]: r for r in rep["rows"] if r.get("peer") == "lmcache"}
    assert set(peer_rows) == {"G2->G4 PUT", "G4->G2 GET"}
    for path, r in peer_rows.items():
        kv = next(x for x in rep["rows"] if x["path"] == path and x["kvbm"] == r["kvbm"] and not x.get("peer"))
        assert r["baseline"].startswith("LMCache 0.5") and r["baseline_MBps"] > 0 and r["baseline_cpu_s_per_GB"] > 0
        assert r["MBps"] == kv["MBps"] and r["ratio"] == pytest.approx(kv["MBps"] / r["baseline_MBps"], rel=1e-2)
        # Like-for-like concurrency is stated: LMCache's measured connections and kvbm's in-flight depth.
        assert r["peer_in_flight"] >= 1 and f"<= {r['peer_in_flight']} conns" in r["baseline"]
        assert r["s3_in_flight"] == 8
        # One kvbm run and one LMCache pass per round, paired.
        assert len(r["ratio_rounds"]) == len(kv["MBps_runs"]) == len(r["baseline_MBps_runs"]) == 1
        assert r["ratio_rounds"][0] == pytest.approx(kv["MBps_runs"][0] / r["baseline_MBps_runs"][0], rel=2e-2)
    assert "LMCache" in res.output
    assert not any(tmp_path.glob("kvbm-bench-*")), "temp dirs left behind"
