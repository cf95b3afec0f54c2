"""``kvbm bench trace`` on a short slice of the shipped Mooncake trace: a real daemon, every byte checked.

Not a benchmark: it asserts only that the figures are there, consistent, and that nothing was served wrong.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from click.testing import CliRunner

from kvbm.bench.trace_sim import SHIPPED_TRACE
from kvbm.cli.bench import bench


def _slice(tmp_path: Path, n: int) -> Path:
    out = tmp_path / "slice.jsonl"
    with gzip.open(SHIPPED_TRACE, "rt") as f:
        out.write_text("".join(next(f) for _ in range(n)))
    return out


def _run(args: list[str]) -> str:
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def _check_run(r: dict, sim: dict) -> None:
    assert r["wrong_blocks"] == 0
    assert r["verified_blocks"] == r["hit_blocks"] > 0
    assert r["block_refs"] == sim["block_refs"]
    assert abs(sum(r["served_share"].values()) - r["hit_ratio"]) < 1e-3
    assert r["latency_ms"]["p50"] <= r["latency_ms"]["p90"] <= r["latency_ms"]["p99"]
    assert r["daemon_requests_per_s"] > 0 and r["daemon_events_per_s"] > 0
    assert r["tier_bytes"]["G2"]["bytes_in"] >= r["bytes_stored"] > 0


def test_bench_trace_slice(tmp_path: Path) -> None:
    trace = _slice(tmp_path, 80)
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    out = _run(["trace", "--trace", str(trace), "--speedup", "200", "--capacities", "0.1,0.5",
                "--g2-share", "0.5", "--json", str(js), "--plot", str(png), "--workdir", str(tmp_path)])
    assert "Belady" in out and "G2+G3" in out
    rep = json.loads(js.read_text())
    assert rep["trace"]["requests"] == 80
    b = rep["simulated"]
    for row in b["by_capacity"]:
        assert 0 < row["lru"] <= row["belady"] <= b["infinite"] <= 1
    assert len(rep["runs"]) == 2
    for r in rep["runs"]:
        _check_run(r, rep["trace"])
        # The daemon cannot beat the offline optimum of its capacity (a block is one trace block).
        assert r["hit_ratio"] <= b["infinite"] + 1e-9
    assert png.stat().st_size > 1000


def test_bench_trace_s3_on(tmp_path: Path, s3_server) -> None:
    trace = _slice(tmp_path, 40)
    js = tmp_path / "t.json"
    _run(["trace", "--trace", str(trace), "--speedup", "200", "--capacities", "0.2", "--g2-share", "0.5",
          "--s3", "on", "--s3-endpoint", s3_server.endpoint, "--s3-access-key", s3_server.access_key,
          "--s3-secret-key", s3_server.secret_key, "--s3-bucket", s3_server.bucket, "--json", str(js),
          "--workdir", str(tmp_path)])
    rep = json.loads(js.read_text())
    (r,) = rep["runs"]
    _check_run(r, rep["trace"])
    assert r["s3"] == "on"
    assert s3_server.secret_key not in js.read_text()
    # The run's objects are deleted afterwards (the bucket is the endpoint's, not the bench's); they used to stay.
    from kvbm.bench.common import boto3_client

    cli = boto3_client({"endpoint": s3_server.endpoint, "access_key": s3_server.access_key,
                        "secret_key": s3_server.secret_key})
    try:
        left = cli.list_objects_v2(Bucket=s3_server.bucket, Prefix="kvbm-bench-").get("Contents", ()) or ()
    finally:
        cli.close()
    assert not [o["Key"] for o in left if "/c0.2-s3on-" in o["Key"]]


def test_bench_trace_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [0, 1]}\n{"timestamp": 5, "hash_ids": "x"}\n')
    res = CliRunner().invoke(bench, ["trace", "--trace", str(bad)])
    assert res.exit_code != 0
    assert "bad.jsonl:2: hash_ids" in res.output
