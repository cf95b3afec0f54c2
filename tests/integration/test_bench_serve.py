"""Smoke test of ``kvbm bench serve``: tiny sizes, the real OpenAI server with KvbmConnector and a real daemon
and SeaweedFS; every figure is there and hits are hits. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from needs import needs

from kvbm.bench.serve import error_line, stage_rows, timeline, ttft_rows
from kvbm.cli.bench import bench

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_error_line_is_the_last_exception() -> None:
    log = ("INFO start\nTraceback (most recent call last):\n  File x\n"
           "RuntimeError: No supported cpu connector found.\nINFO shutting down\n")
    assert error_line(log) == "RuntimeError: No supported cpu connector found."
    assert error_line("just one line") == "just one line"
    wrapped = ("RuntimeError: Worker failed with error 'CPU Offloading is currently only supported on CUDA-alike'\n"
               "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert error_line(wrapped).startswith("RuntimeError: Worker failed with error 'CPU Offloading")


def test_timeline_is_bandwidth_between_samples() -> None:
    s = [{"t": 0.0, "G2": {"in": 0, "out": 0, "hits": 0}, "onboard_blocks": 0, "offload_blocks": 0},
         {"t": 2.0, "G2": {"in": 4_000_000, "out": 2_000_000, "hits": 1}, "onboard_blocks": 3, "offload_blocks": 1}]
    tl = timeline(s, block_bytes=1_000_000)
    assert tl["t"] == [2.0] and tl["G2 write"] == [2.0] and tl["G2 read"] == [1.0]
    assert tl["onboard G2->G1"] == [1.5] and tl["offload G1->G2"] == [0.5]


@pytest.mark.slow
@pytest.mark.s3
@needs("vllm", HAVE_VLLM, "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
def test_bench_serve_smoke(s3_server, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = ["serve", "--workloads", "long-doc-qa,ttft-length,multi-turn", "--sources", "kvbm",
            "--docs", "2", "--doc-tokens", "600", "--queries", "1", "--concurrency", "2", "--lengths", "600",
            "--repeats", "1", "--s3-clients", "http", "--sessions", "1", "--turns", "2", "--turn-tokens", "300",
            "--max-tokens", "4", "--vllm-kv", "64MiB", "--g2", "256KiB", "--g3", "1MiB", "--layers", "2",
            "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "1000",
            "--s3-endpoint", s3_server.endpoint, "--s3-access-key", s3_server.access_key,
            "--s3-secret-key", s3_server.secret_key, "--s3-bucket", s3_server.bucket,
            "--workdir", str(tmp_path), "--json", str(out), "--plot", str(tmp_path / "serve.png")]
    for extra, words in (("[1]", "a JSON object"), ('{"daemon": "tcp://x:1"}', "daemon: set by the bench")):
        bad = CliRunner().invoke(bench, [*args, "--connector-extra", extra], catch_exceptions=False)
        assert bad.exit_code == 2 and "--connector-extra" in bad.output and words in bad.output, bad.output
    args += ["--connector-extra", '{"hook_warn_ms": 50}']
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert s3_server.secret_key not in out.read_text()
    assert (tmp_path / "serve.png").stat().st_size > 0
    cmd = report["servers"]["kvbm"]["command"]
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["hook_warn_ms"] == 50 and extra["daemon"]  # --connector-extra merged into the bench's own
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["load_avg_1_5_15"]
    q = report["long_doc_qa"]["kvbm"]["queries"]
    assert q["n_errors"] == 0 and q["requests"] == 2 and q["ttft_s"]["p95"] > 0
    # 600 + 32 question tokens: 4 full vLLM blocks, 2 kvbm blocks of 256 tokens each from kvbm.
    assert q["cached_tokens_mean"] == 512, q
    assert report["long_doc_qa"]["kvbm"]["timeline"]["t"]
    rows = {r["source"]: r for r in ttft_rows(report)}
    assert set(rows) == {"first", "G2", "G3", "G4-http", "G1-kvbm"}  # G1-kvbm: vLLM's own hit in the kvbm server
    assert rows["first"]["cached_tokens"] == 0
    for src in ("G2", "G3", "G4-http"):
        assert rows[src]["cached_tokens"] == 512 and rows[src]["same_text"], rows[src]
    g3 = report["ttft_length"]["G3"]["600"][0]["tier_hits"]
    g4 = report["ttft_length"]["G4-http"]["600"][0]["tier_hits"]
    assert g3["G3"] >= 2 and g4["G4"] >= 2 and g4["G3"] == 0, (g3, g4)
    # The load path stage by stage: every kvbm hit copied exactly its cached tokens' bytes into vLLM's paged KV,
    # in its vLLM blocks, inside the synchronous load's hook time; the rest of the prompt was computed.
    # (the model's "kv_token_bytes": a key ending in "_token" is masked as a credential in the JSON)
    bpt, vbs = report["model"]["kv_token_bytes"], report["options"]["block_size"]
    assert bpt == report["kvbm_block_bytes"] // report["kvbm_block_tokens"], report["model"]
    # After the daemon's restart the warm-up hit its prompt until a hit's blocks were copied in (the workers had met
    # the new daemon and mapped its pool): the timed hits after it are steady-state hits.
    for name, tries in report["ttft_length"]["after_restart"].items():
        assert tries[-1]["copy_in_bytes"] > 0 and tries[-1]["cached_tokens"] > 0, (name, json.dumps(tries))
    stages = {(r["source"], r["tokens"]): r for r in stage_rows(report)}
    assert {("G2", 600), ("G3", 600), ("G4-http", 600), ("long-doc-qa queries", None)} <= set(stages), stages
    for src in ("G2", "G3", "G4-http"):
        st = stages[(src, 600)]
        # (a str message is printed whole: a dict's is cut short)
        what = json.dumps({"row": st, "after_restart": report["ttft_length"]["after_restart"]})
        assert st["copy_in_bytes"] == st["cached_tokens"] * bpt == 512 * bpt, what
        assert st["copy_in_vblocks"] == st["cached_tokens"] // vbs and st["copy_in_gbps"] > 0, what
        assert st["computed_after_hit_tokens"] == st["prompt_tokens"] - st["cached_tokens"] > 0, what
        assert st["load_hook_ms"] >= st["copy_in_ms"] > 0, what
        # the lookup's round trip and the sync load's pins (scheduler; an async load's Onboards: the worker's) are
        # counted where they happen
        assert st["lookups"] >= 1 and st["lookup_ms"] > 0 and st["pins"] >= 1 and st["pin_ms"] > 0, what
        assert st["ttft_ms"] > 0 and st["tier_hits"] == report["ttft_length"][src]["600"][0]["tier_hits"], what
    ld = stages[("long-doc-qa queries", None)]
    assert ld["copy_in_bytes"] % (vbs * bpt) == 0, ld  # whole vLLM blocks (none if vLLM kept the documents)
    assert ld["copy_in_bytes"] <= q["cached_tokens_mean"] * q["requests"] * bpt, ld  # G1 hits copy nothing
    assert ld["computed_after_hit_tokens_mean"] == q["prompt_tokens_mean"] - q["cached_tokens_mean"], ld
    turns = report["multi_turn"]["kvbm"][0]
    assert turns[0]["cached_tokens"] == 0 and turns[1]["cached_tokens"] >= 256, turns
    assert not list(tmp_path.glob("kvbm-bench-serve-*")), "temp dirs left behind"
