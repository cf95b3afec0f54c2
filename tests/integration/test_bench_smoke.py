"""Smoke tests of ``kvbm bench``: a tiny configuration of each bench runs and its JSON has every figure.

Benchmarks are not tests: nothing here asserts a timing, only that the figures are there and sane.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from needs import needs

from kvbm.cli.bench import bench

pytestmark = pytest.mark.s3

FAKE_ENV_SECRETS = {"AWS_SECRET_ACCESS_KEY": "fake-env-aws-secret-5f1c9e", "AWS_SESSION_TOKEN": "fake-env-token-77ab01",
                    "KVBM_S3_SECRET_KEY": "fake-env-kvbm-secret-c0ffee"}


@pytest.fixture(autouse=True)
def fake_credentials(monkeypatch):
    """Credentials in the environment as a user would have them; none may reach a report."""
    for k, v in FAKE_ENV_SECRETS.items():
        monkeypatch.setenv(k, v)


def _no_secrets(srv, tmp_path: Path, *texts: str) -> None:
    """No credential (the server's secret key, the environment's) in any output file or printed text."""
    secrets = [srv.secret_key, *FAKE_ENV_SECRETS.values()]
    blobs = [t.encode() for t in texts] + [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    for s in secrets:
        assert not any(s.encode() in b for b in blobs), f"secret {s[:4]}... leaked into the bench output"


def _s3_args(srv) -> list[str]:
    return ["--s3-endpoint", srv.endpoint, "--s3-access-key", srv.access_key, "--s3-secret-key", srv.secret_key,
            "--s3-bucket", srv.bucket]


def _run(args: list[str]) -> str:
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def _check_machine(report: dict) -> None:
    m = report["machine"]
    assert m["cpu_count"] >= 1 and m["python"] and m["torch"] and m["memory_bytes"] > 0


def _no_leftovers(tmp_path: Path) -> None:
    assert not any(tmp_path.glob("kvbm-bench-*")), "temp dirs left behind"
    assert not list(Path("/dev/shm").glob(f"kvbm-g2-{os.getpid()}-*")), "G2 pools left in /dev/shm"


def _objects(srv, prefix: str = "kvbm-bench-") -> list[str]:
    from kvbm.bench.common import boto3_client

    cli = boto3_client({"endpoint": srv.endpoint, "access_key": srv.access_key, "secret_key": srv.secret_key})
    try:
        resp = cli.list_objects_v2(Bucket=srv.bucket, Prefix=prefix)
        return [o["Key"] for o in resp.get("Contents", ()) or ()]
    finally:
        cli.close()


def test_bench_tiers_tiny(s3_server, tmp_path):
    out = tmp_path / "tiers.json"
    png = tmp_path / "tiers.png"
    work = tmp_path / "not" / "made"  # a --workdir that does not exist yet is made (was a FileNotFoundError traceback)
    text = _run(["tiers", "--block-size", "256KiB", "--blocks", "4", "--repeats", "1", "--workdir", str(work),
                 "--json", str(out), "--plot", str(png), *_s3_args(s3_server)])
    assert work.is_dir() and not any(work.iterdir())
    assert "G4->G2 GET" in text
    rep = json.loads(out.read_text())
    _check_machine(rep)
    paths = {(r["path"], r["kvbm"]) for r in rep["rows"]}
    names = {p for p, _ in paths}
    assert {"G2->G1 copy", "G1->G2 copy", "G2->G3 write", "G3->G2 read cold", "G3->G2 read warm", "G2->G4 PUT",
            "G4->G2 GET"} <= names
    clients = rep["paths"]["s3_clients"]
    assert "aiobotocore" in clients
    for r in rep["rows"]:
        assert r["baseline_MBps"] > 0
        if r["kvbm"] != "-":
            assert r["MBps"] > 0 and r["ratio"] > 0 and r["cpu_s_per_GB"] >= 0
    assert png.stat().st_size > 1000
    _no_leftovers(work)
    assert not _objects(s3_server), "bench objects left in the bucket"
    _no_secrets(s3_server, tmp_path, text)


def test_bench_manager_tiny(s3_server, tmp_path):
    out = tmp_path / "manager.json"
    text = _run(["manager", "--registered", "3000", "--prefix-blocks", "100", "--lookups", "20",
                 "--daemon-events", "400", "--daemon-lookups", "10", "--onboard-blocks", "3", "--block-size", "64KiB",
                 "--repeats", "1", "--workdir", str(tmp_path), "--json", str(out), *_s3_args(s3_server)])
    rep = json.loads(out.read_text())
    _check_machine(rep)
    metrics = {(r["metric"], r["via"].split(" ")[0]) for r in rep["rows"]}
    assert ("block events ingested", "registry.add") in metrics
    assert ("lookup 100-block prefix p99", "manager.lookup") in metrics
    assert any(m == "index memory per block" for m, _ in metrics)
    assert {"onboard overhead vs raw G3 transfer", "onboard overhead vs raw G4 transfer"} <= {m for m, _ in metrics}
    if rep["daemon"]["available"]:
        assert ("block events ingested", "daemon") in metrics
    for r in rep["rows"]:
        assert isinstance(r["value"], float | int)
    _no_leftovers(tmp_path)
    assert not _objects(s3_server)
    _no_secrets(s3_server, tmp_path, text)


def test_bench_long_doc_qa_tiny(s3_server, tmp_path):
    out = tmp_path / "ldqa.json"
    png = tmp_path / "ldqa.png"
    text = _run(["long-doc-qa", "--doc-lengths", "64,128", "--docs", "2", "--queries", "1", "--query-tokens", "8",
          "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "500", "--tokens-per-block", "32",
          "--order", "random", "--inflight", "2", "--workdir", str(tmp_path), "--json", str(out), "--plot", str(png),
          *_s3_args(s3_server)])
    rep = json.loads(out.read_text())
    _check_machine(rep)
    got = {(r["doc_tokens"], r["source"]) for r in rep["rows"]}
    assert got == {(n, s) for n in (64, 128) for s in ("recompute", "G2", "G3", "G4")}
    for r in rep["rows"]:
        assert r["ttft_ms"]["n"] == 2 and r["ttft_ms"]["p50"] > 0
        if r["source"] != "recompute":
            assert r["max_abs_logit_diff_vs_recompute"] < 1e-3  # a hit gives the recompute's answer
            assert set(r["breakdown_ms"]) == {"lookup", "onboard", "unpack", "prefill"}
    assert png.stat().st_size > 1000
    _no_leftovers(tmp_path)
    assert not _objects(s3_server)
    _no_secrets(s3_server, tmp_path, text)


@pytest.mark.slow
@needs("vllm", importlib.util.find_spec("vllm") is not None,
       "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
def test_bench_long_doc_qa_vllm_tiny(s3_server, tmp_path):
    """The vLLM engine end to end at a tiny size (TP=1, one 512-token document): a real vLLM with KvbmConnector
    against a daemon subprocess; every source is timed, every hit came from its tier with the G1 reference's
    answer, and the three parts of each hit are in the JSON."""
    out = tmp_path / "ldqa-vllm.json"
    png = tmp_path / "ldqa-vllm.png"
    text = _run(["long-doc-qa", "--engine", "vllm", "--doc-lengths", "512", "--docs", "1", "--queries", "1",
                 "--query-tokens", "8", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                 "--vocab", "1000", "--tp", "1", "--workdir", str(tmp_path), "--json", str(out), "--plot", str(png),
                 *_s3_args(s3_server)])
    rep = json.loads(out.read_text())
    _check_machine(rep)
    assert rep["engine"] == "vllm"
    rows = {r["source"]: r for r in rep["rows"]}
    assert list(rows) == ["recompute", "tail", "G1", "G2", "G3", "G4"]
    assert {(r["tp"], r["doc_tokens"]) for r in rep["rows"]} == {(1, 512)}
    assert rows["recompute"]["cached_tokens"] == 0 and rows["tail"]["prompt_tokens"] == 8
    (length,) = rep["runs"]["tp1"]["lengths"]
    assert length["blocks_per_doc"] == 2 and length["hit_tokens"] == 512
    for r in rep["rows"]:
        assert r["ttft_ms"]["n"] == 1 and r["ttft_ms"]["p50"] > 0
    for src in ("G1", "G2", "G3", "G4"):
        assert rows[src]["cached_tokens"] == 512, rows[src]
    for src in ("G2", "G3", "G4"):
        r = rows[src]
        assert r["same_tokens_as_G1"] is True  # the loaded KV gives the answer of vLLM's own cached KV
        assert r["tier_MBps"] > 0 and r["bytes"] == 2 * 128 * 1024
        assert set(r["parts_ms"]) == {"a_move", "b_tail_prefill", "c_rest"}
        assert r["parts_ms"]["b_tail_prefill"] == pytest.approx(rows["G1"]["ttft_ms"]["p50"], abs=0.01)
        assert r["ratio"] > 0 and isinstance(r["meets_goal"], bool)
    g3, g4 = (length["runs"][i] for i in (4, 5))
    assert g3["source"] == "G3" and g3["tier_hits"]["G3"] >= 2 and g3["tier_hits"]["G4"] == 0
    assert g4["source"] == "G4" and g4["tier_hits"]["G4"] >= 2
    for tier in ("G2", "G3", "G4"):
        assert length["bandwidth"][tier]["MBps"] > 0
    assert "TTFT/(a+b)" in text and png.stat().st_size > 1000
    _no_leftovers(tmp_path)
    assert not list(Path("/dev/shm").glob(f"kvbm-g2-{rep['runs']['tp1']['daemon_pid']}-*")), "daemon's G2 pool left"
    assert not _objects(s3_server)
    _no_secrets(s3_server, tmp_path, text)


def test_vllm_engine_cleanup_removes_only_unmapped_shm(tmp_path):
    """After a killed engine the bench removes vLLM's leftover /dev/shm queues, never one still mapped."""
    import mmap
    import time

    from kvbm.bench.longdoc_vllm import _remove_orphan_shm

    since = time.time() - 1
    tag = f"psm_kvbmtest{os.getpid()}"
    orphan, live = Path(f"/dev/shm/{tag}a"), Path(f"/dev/shm/{tag}b")
    orphan.write_bytes(b"x" * 4096)
    live.write_bytes(b"x" * 4096)
    try:
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            _remove_orphan_shm(since, pattern=f"{tag}*")
            assert not orphan.exists() and live.exists()
    finally:
        orphan.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_pack_unpack_round_trip():
    import torch

    from kvbm.bench.longdoc import TinyDecoder, pack_block, unpack_blocks
    from kvbm.blocks.layout import KVLayout

    m = TinyDecoder(2, 32, 2, 100)
    lay = KVLayout(model="t", num_layers=2, num_kv_heads=2, head_size=16, dtype="float32", tokens_per_block=8,
                   block_bytes=1)
    toks = torch.arange(24) % 100
    _, kv = m.prefill(toks)
    blocks = [torch.from_numpy(pack_block(kv, b, 8).copy()) for b in range(3)]
    assert all(b.numel() == lay.block_nbytes for b in blocks)
    back = unpack_blocks(blocks, lay)
    for (k, v), (k2, v2) in zip(kv, back, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # prefill with the cached prefix equals the full prefill
    full, _ = m.prefill(torch.arange(30) % 100)
    part, _ = m.prefill(torch.arange(24, 30) % 100, back)
    assert torch.allclose(full, part, atol=1e-4)


def test_bench_fleet_smoke(s3_server, tmp_path):
    """Two daemons on one bucket and a small listing: every figure is in the JSON; a block B never finds is
    counted as such, never timed."""
    out = tmp_path / "fleet.json"
    text = _run(["fleet", "--blocks", "2", "--hit-timeout", "1", "--lookups", "5", "--listing-sizes", "300",
                 "--put-concurrency", "32", "--workdir", str(tmp_path), *_s3_args(s3_server), "--json", str(out)])
    r = json.loads(out.read_text())
    _check_machine(r)
    f = r["fleet"]
    assert f["daemons"] == 2 and f["found"] + f["never_found"] == 2
    assert (f["ack_to_hit_s"] is None) == (f["found"] == 0)
    assert f["lookup_miss_s"]["n"] == 5 and f["lookup_hit_g2_s"]["n"] == 5
    (row,) = r["listing"]
    assert row["objects"] == 300 and row["serial"]["listed"] == 300 and row["parallel"]["listed"] == 300
    assert "error" not in row
    assert not _objects(s3_server), "bench objects left in the bucket"
    _no_secrets(s3_server, tmp_path, text)
    _no_leftovers(tmp_path)


def test_bench_fleet_fanout_smoke(s3_server, tmp_path):
    """Two daemons that find each other through the bucket: each block one stores is found by the other, with
    events and with probes alone (after the negative TTL), and loads byte-exact; nothing is left behind."""
    out = tmp_path / "fanout.json"
    text = _run(["fleet", "--groups", "fanout", "--fanout-daemons", "2", "--rounds", "2", "--negative-ttl", "0.3",
                 "--hit-timeout", "20", "--workdir", str(tmp_path), *_s3_args(s3_server), "--json", str(out)])
    r = json.loads(out.read_text())
    _check_machine(r)
    for mode in ("events", "probe"):
        f = r["fanout"][mode]
        assert f["daemons"] == 2 and f["acked"] == 2 and f["samples"] == 2 and f["never_found"] == 0
        assert f["verified_loads"] == 2 and f["wrong_bytes"] == 0 and f["missing_loads"] == 0
        assert set(f["found_s"]) >= {"p50", "p95", "max"}
    assert r["fanout"]["events"]["mesh_s"] >= 0 and "probe_over_events_p50" in r["fanout"]
    assert "found by every other" in text
    assert not _objects(s3_server), "bench objects (blocks or memberships) left in the bucket"
    _no_secrets(s3_server, tmp_path, text)
    _no_leftovers(tmp_path)
