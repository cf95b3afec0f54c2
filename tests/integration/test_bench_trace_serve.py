"""Smoke test of ``kvbm bench trace-serve``: a small conversation slice of the shipped trace through vLLM's real
OpenAI server, alone and with KvbmConnector against a real daemon and SeaweedFS. No timing is asserted (benchmarks
are not tests): every request answered, kvbm served the turns vLLM's small KV space had evicted, and each of its
completions is vLLM alone's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from needs import needs

from kvbm.bench.trace_serve import IdTokens, conversation_slice
from kvbm.bench.trace_sim import TraceRequest
from kvbm.cli.bench import bench

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_the_slice_keeps_whole_conversations_and_their_prefixes() -> None:
    reqs = [TraceRequest(0, 0, 0, (0, 1, 2)), TraceRequest(0, 0, 0, (0, 5)), TraceRequest(9, 0, 0, (0, 1, 2, 3, 4)),
            TraceRequest(20, 0, 0, (0, 1, 2, 3, 4, 7)), TraceRequest(30, 0, 0, (0, 8, 9)),
            TraceRequest(40, 0, 0, (0, 8, 9, 10))]
    got = conversation_slice(reqs, conversations=1, turns=2, max_blocks=4)
    assert [r.hash_ids for r in got] == [(0, 1, 2), (0, 1, 2, 3)]  # the one-turn conversation (0, 5) is left out
    toks = IdTokens(32, 1000, seed=0)
    assert toks.prompt([0, 1])[:32] == toks.of(0) == IdTokens(32, 1000, seed=0).of(0) != toks.of(1)
    assert all(3 <= t < 1000 for t in toks.of(2))


@pytest.mark.slow
@pytest.mark.s3
@needs("vllm", HAVE_VLLM, "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
def test_bench_trace_serve_smoke(s3_server, tmp_path: Path) -> None:
    out = tmp_path / "ts.json"
    args = ["trace-serve", "--conversations", "4", "--turns", "3", "--max-blocks", "16",
            "--tokens-per-id", "32", "--concurrency", "1", "--max-tokens", "4", "--layers", "2", "--hidden", "128",
            "--heads", "4", "--kv-heads", "2", "--vocab", "1000",
            "--s3-endpoint", s3_server.endpoint, "--s3-access-key", s3_server.access_key,
            "--s3-secret-key", s3_server.secret_key, "--s3-bucket", s3_server.bucket,
            "--workdir", str(tmp_path), "--json", str(out)]
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert s3_server.secret_key not in out.read_text()
    n = rep["slice"]["requests"]
    assert n == 10 and rep["slice"]["conversations"] == 4
    v, k = rep["sources"]["vllm"], rep["sources"]["kvbm"]
    for r in (v, k):
        assert r["n_errors"] == 0 and r["requests"] == n
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
        assert r["command"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    # vLLM's KV space holds 20 of the slice's 60 blocks: later turns find their history in kvbm, not in vLLM.
    assert k["kvbm_onboard_blocks"] > 0 and k["cached_tokens"] > v["cached_tokens"]
    assert sum(k["kvbm_blocks_read"].values()) > 0
    c = rep["compare"]
    assert c["compared"] == n and c["requests_kvbm_cached_more"] > 0
    assert c["same_completion"] == n, c["differing_requests"]
