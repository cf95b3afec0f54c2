"""``kvbm bench serve``'s options: workloads, sources, the model and server, the daemon's tiers, each workload's
sizes; checked before a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbm.bench.common import BenchTarget
from kvbm.bench.openai_server import DTYPE_BYTES, VLLM_BLOCK, ModelSpec, RandomModelOptions

MiB = 1 << 20
WORKLOADS = ("long-doc-qa", "ttft-length", "multi-turn")
SOURCES = ("vllm", "kvbm", "lmcache", "offloading")
S3_CLIENTS = ("http", "nixl", "aiobotocore")
PEER_CONNECTORS = {
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    "offloading": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"cpu_bytes_to_use": 256 * MiB}},
}


@dataclass
class ServeBenchOptions(BenchTarget, RandomModelOptions):
    workloads: tuple[str, ...] = ("long-doc-qa", "ttft-length")
    sources: tuple[str, ...] = SOURCES
    # the server (the model: RandomModelOptions)
    block_size: int = VLLM_BLOCK
    vllm_kv_bytes: int = 1 << 30
    max_tokens: int = 16  # output tokens per request (greedy, ignore_eos)
    omp_threads: int = 2
    server_python: str | None = None  # the interpreter the servers run in (default: this one)
    peer_python: str | None = None  # ... for the peers (a venv with LMCache installed next to vLLM)
    # the daemon
    vllm_blocks_per_kvbm_block: int = 2
    g2_bytes: int = 256 * MiB
    g3_bytes: int = 768 * MiB
    s3_clients: tuple[str, ...] = S3_CLIENTS
    # long-doc-qa
    docs: int = 16
    doc_tokens: int = 6000
    queries: int = 2
    query_tokens: int = 32
    concurrency: int = 4
    # ttft-length
    lengths: tuple[int, ...] = (1000, 2000, 4000, 8000, 16000)
    repeats: int = 3
    # multi-turn
    sessions: int = 2
    turns: int = 4
    turn_tokens: int = 512
    logs: str | None = None
    connector_extra: dict[str, Any] | None = None  # merged into kvbm's kv_connector_extra_config
    request_timeout_s: float = 600.0
    sample_s: float = 0.5  # the daemon's tier counters are sampled this often (the bandwidth timeline)

    def check(self) -> None:
        bad = set(self.workloads) - set(WORKLOADS)
        if bad:
            raise ValueError(f"unknown workloads {sorted(bad)}; known: {', '.join(WORKLOADS)}")
        bad = set(self.sources) - set(SOURCES)
        if bad:
            raise ValueError(f"unknown sources {sorted(bad)}; known: {', '.join(SOURCES)}")
        bad = set(self.s3_clients) - set(S3_CLIENTS)
        if bad:
            raise ValueError(f"unknown S3 clients {sorted(bad)}; known: {', '.join(S3_CLIENTS)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        if self.block_size % 32:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU backend takes multiples of 32")
        if self.concurrency < 1 or self.docs < 1 or self.queries < 1 or self.repeats < 1:
            raise ValueError("concurrency, docs, queries and repeats must be >= 1")
        if min(self.lengths, default=self.kvbm_block_tokens) < self.kvbm_block_tokens:
            raise ValueError(f"every length must hold one kvbm block ({self.kvbm_block_tokens} tokens)")

    @property
    def model(self) -> ModelSpec:
        return self.model_spec(self.max_model_len)

    @property
    def kvbm_block_tokens(self) -> int:
        return self.block_size * self.vllm_blocks_per_kvbm_block

    @property
    def block_bytes(self) -> int:
        return self.kvbm_block_tokens * self.model_bytes_per_token

    @property
    def model_bytes_per_token(self) -> int:
        return self.model.bytes_per_token

    @property
    def max_model_len(self) -> int:
        need = [self.doc_tokens + self.query_tokens, self.turns * (self.turn_tokens + self.max_tokens), *self.lengths]
        return (max(need) + self.max_tokens + 2 * self.block_size) // self.block_size * self.block_size

