"""``kvbm bench p2p-serve`` at tiny sizes: three real vLLM OpenAI servers with KvbmConnector, three daemons and one
SeaweedFS. A prompt node A's engine computed is served on node B from A's G2 over NIXL (no bucket GET on B) and on
node C from the bucket, both as far as kvbm's blocks go. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from needs import needs, require

from kvbm.cli.bench import bench
from kvbm.transfer import nixl_available

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.s3
@needs("vllm", HAVE_VLLM, "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
def test_bench_p2p_serve_tiny(s3_server: Any, tmp_path: Path) -> None:
    ok, why = nixl_available()
    require("nixl", ok, f"peer reads are NIXL UCX READs: {why}")
    out = tmp_path / "p2p-serve.json"
    args = ["p2p-serve", "--prompt-tokens", "600", "--repeats", "1", "--tokens-per-block", "256", "--layers", "2",
            "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "1000", "--vllm-kv", "64MiB",
            "--g2", "8MiB", "--max-tokens", "4", "--peer-budget-ms", "30000",  # never late: no timing asserted
            "--s3-endpoint", s3_server.endpoint, "--s3-access-key", s3_server.access_key,
            "--s3-secret-key", s3_server.secret_key, "--s3-bucket", s3_server.bucket,
            "--workdir", str(tmp_path / "work"), "--json", str(out)]
    bad = CliRunner().invoke(bench, [*args, "--g2", "64KiB"], catch_exceptions=False)
    assert bad.exit_code == 2 and "holds fewer than the 2 prompts' blocks" in bad.output, bad.output
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["rdma"].startswith("not run") and report["repeats_without_as_blocks"] == 0
    for row in (report["first_contact"], *report["repeats"]):
        computed, peer, bucket = row["computed"], row["peer"], row["bucket"]
        assert row["a_stored_blocks"] >= 2, row
        assert not (computed["error"] or peer["error"] or bucket["error"]), row
        assert computed["prompt_tokens"] >= 600 and computed["cached_tokens"] == 0
        # Two full kvbm blocks of 256 tokens: B read them from A's G2 and made no GET; C got them from the bucket.
        assert peer["cached_tokens"] == 512 and peer["peer_blocks"] >= 2 and peer["bucket_gets"] == 0, row
        assert peer["peer_late"] == peer["peer_refused"] == peer["peer_failed"] == 0, row
        assert bucket["cached_tokens"] == 512 and bucket["peer_blocks"] == 0 and bucket["bucket_gets"] >= 2, row
        assert peer["text"] == bucket["text"], row  # the same KV: the same greedy tokens
        local = row["local"]  # B again, vLLM's own cache emptied: from B's own G2, no peer read, no GET
        assert local["cached_tokens"] == 512 and local["peer_blocks"] == 0 and local["bucket_gets"] == 0, row
        assert local["text"] == peer["text"], row
    assert report["peer"]["ttft_ms_median"] > 0 and report["bucket"]["ttft_ms_median"] > 0
    assert report["peer_path_clean"] is True
    assert "| peer | B |" in res.output and "A's side of it" in res.output
    assert not list((tmp_path / "work").glob("kvbm-p2p-serve-*")), "temp dirs left behind"
    assert s3_server.secret_key not in out.read_text()
