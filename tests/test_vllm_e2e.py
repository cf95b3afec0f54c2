"""KvbmConnector inside a real vLLM (CPU build, tiny random Llama), against a real daemon and SeaweedFS.

Nothing here is simulated: vLLM runs its own EngineCore and Worker processes with the connector loaded
from ``kvbm.integrations.vllm``; the daemon runs as ``python -m kvbm.cli.serve``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")

from serve_proc import ServeProc

from kvbm.vllm_hash import vllm_block_hashes

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
VLLM_BS = 128
K = 2  # vLLM blocks per kvbm block
PROMPT = [(i * 7 + 3) % 997 + 3 for i in range(2000)]
HASH_SEED = "0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


class Daemon(ServeProc):
    """The kvbm daemon on loopback TCP, following the engine's KV events."""

    def __init__(self, tmp: Path, s3, bucket: str) -> None:
        self.vllm_events = f"tcp://127.0.0.1:{free_port()}"
        super().__init__(tmp, {
            "block_bytes": "128KiB",
            "device": {"enabled": False},
            "host": {"capacity": "4MiB"},
            "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False},
            "s3": {"endpoint": s3.endpoint, "access_key": s3.access_key, "secret_key": s3.secret_key,
                   "bucket": bucket, "prefix": "e2e"},
            "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "metrics_port": 0, "vllm_events": [self.vllm_events]},
        })

    def stats(self) -> dict:
        with self.client(timeout_s=5) as c:
            return c.stats()

    def resident(self, engine: str) -> set:
        """The engine's GPU-resident block hashes as the daemon knows them from its KV events."""
        with self.client(timeout_s=5) as c:
            return set(c.stats(resident=True)["engines"][engine]["resident"])


def run_vllm(tmp: Path, name: str, model: str, daemon: Daemon | None, steps: list[dict], *,
             connector: bool = True, events: str | None = None) -> list[dict]:
    spec = {"model": model, "prompt": PROMPT, "steps": steps, "prefix_caching": bool(events), "events": events}
    if connector:
        assert daemon is not None
        spec["connector"] = {"daemon": daemon.endpoint, "model_name": "tiny-llama-e2e",
                             "vllm_blocks_per_kvbm_block": K, "timeout_s": 5}
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": HASH_SEED, "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2"}
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.run([sys.executable, str(HERE / "vllm_runner.py"), str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=400)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM run {name} failed:\n" + (tmp / f"{name}.log").read_text()[-4000:])
    return json.loads(out_path.read_text())["results"]


def tier_hits(stats: dict) -> dict[str, int]:
    return {t["tier"]: t["stats"]["hits"] for t in stats["tiers"]}


def test_connector_end_to_end(tmp_path, tiny_model, s3_server):
    daemon = Daemon(tmp_path, s3_server, f"kvbm-e2e-{uuid.uuid4().hex[:8]}")
    try:
        daemon.start()
        # 0. Reference: a vLLM with no connector at all.
        baseline = run_vllm(tmp_path, "baseline", tiny_model, None, [{}], connector=False)[0]

        # 1. First engine: computes the prompt, stores its full blocks through kvbm, publishes KV events.
        first = run_vllm(tmp_path, "store", tiny_model, daemon, [{}], events=daemon.vllm_events)[0]
        assert first["tokens"] == baseline["tokens"]
        assert first["kv_transfer_params"]["kvbm"]["degraded"] is False
        full_kvbm_blocks = (len(PROMPT) - 1) // (VLLM_BS * K)  # 7 blocks = 1792 tokens
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = daemon.stats()
            if st["manager"]["cascade_writes"] >= 2 * full_kvbm_blocks and not st["manager"]["pending_cascades"]:
                break
            time.sleep(0.5)
        g = {t["tier"]: t for t in st["tiers"]}
        assert g["G3"]["blocks"] >= full_kvbm_blocks and g["G4"]["blocks"] >= full_kvbm_blocks

        # 5. The daemon followed the engine's KV events: vLLM's own block hashes are resident on its GPU.
        expected = {int.from_bytes(h[-8:], "big") for h in vllm_block_hashes(PROMPT, VLLM_BS, seed=HASH_SEED)}
        engines = st["engines"]
        assert len(engines) == 1
        view = next(iter(engines.values()))
        assert view["blocks"].get("GPU", 0) >= len(expected) and view["gaps"] == 0, view
        assert expected <= daemon.resident(next(iter(engines)))

        # 2 + 3. A fresh engine: the prefix comes from kvbm (G2), then again from S3 (G4) alone.
        before = tier_hits(daemon.stats())
        hit, evicted, hit_g4 = run_vllm(tmp_path, "load", tiny_model, daemon,
                                        [{}, {"evict": ["G2", "G3"]}, {}])
        assert hit["num_cached_tokens"] == full_kvbm_blocks * VLLM_BS * K
        assert hit["tokens"] == baseline["tokens"]
        assert evicted["evicted"] >= full_kvbm_blocks
        assert hit_g4["num_cached_tokens"] == full_kvbm_blocks * VLLM_BS * K
        assert hit_g4["tokens"] == baseline["tokens"]
        after = tier_hits(daemon.stats())
        assert after["G4"] - before["G4"] >= full_kvbm_blocks

        # 4. Daemon gone: the engine recomputes, answers the same, and says the connector is degraded.
        daemon.stop()
        down = run_vllm(tmp_path, "down", tiny_model, daemon, [{}])[0]
        assert down["tokens"] == baseline["tokens"]
        assert down["num_cached_tokens"] == 0
        assert down["kv_transfer_params"]["kvbm"]["degraded"] is True
    finally:
        daemon.stop()
