"""Shared fixtures: a real SeaweedFS (the embedded S3 endpoint) for the S3 tier and server tests.

The hooks of tests/needs.py make a skip of a component named in ``KVBM_REQUIRE`` fail (CI sets it).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from needs import (  # noqa: F401  (pytest hooks, found by name in this module)
    pytest_collectreport,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
    require,
)

from kvbm.s3server import EmbeddedS3, weed_runs

# The files that take minutes (a real vLLM, seeded campaigns), longest first (measured under pytest-xdist, 4
# workers on 2 cores). scripts/test.sh hands whole files to its workers (--dist loadfile) in collection order:
# these go out first, so that none of them starts last on an otherwise idle worker.
LONG_FIRST = (
    "integration/test_bench_p2p_serve.py", "integration/test_vllm_e2e.py", "fuzz/test_verify_seeds.py",
    "integration/test_vllm_preemption.py",
    "integration/test_vllm_server_conversations.py", "fuzz/test_verify_gemma2.py", "fuzz/test_verify_directed.py",
    "fuzz/test_hit_numerics.py",
    "integration/test_durability.py", "integration/test_vllm_hits.py", "integration/test_vllm_layouts.py",
    "integration/test_vllm_server.py", "chaos/test_chaos_seeds.py", "integration/test_p2p.py",
    "integration/test_bench_trace_serve.py", "integration/test_security.py", "integration/test_faults_journal.py",
    "integration/test_fleet_durability.py", "integration/test_bench_serve.py", "integration/test_fleet.py",
    "integration/test_vllm_conversation.py", "integration/test_bench_smoke.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {f"tests/{f}": i for i, f in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::", 1)[0], len(LONG_FIRST)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def weed_binary() -> str:
    ok, why = weed_runs()
    require("s3", ok, f"SeaweedFS cannot run here: {why}")
    return why


@pytest.fixture(scope="session")
def s3_server(weed_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    """One SeaweedFS for the whole session (stopped with SIGTERM, SIGKILL after 2 s)."""
    srv = EmbeddedS3(tmp_path_factory.mktemp("seaweedfs"), weed=weed_binary, bucket="kvbm-test",
                     stop_timeout_s=2.0, reuse=False)
    with srv:
        yield srv


@pytest.fixture
def s3_prefix(s3_server: EmbeddedS3) -> str:
    """A fresh key prefix per test, inside the session bucket ``s3_server.bucket``."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_bucket(s3_server: EmbeddedS3) -> str:
    """A fresh, not yet created bucket name (>= 3 chars, lowercase)."""
    return f"kvbm-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama saved locally (2 layers, 2 KV heads): what the vLLM tests run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture
def nodes() -> Iterator[list]:
    """Daemon nodes a fleet test starts (anything with ``stop()``); each is stopped when the test ends."""
    started: list = []
    yield started
    for n in started:
        n.stop()
