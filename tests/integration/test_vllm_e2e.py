"""KvbmConnector inside a real vLLM (CPU build, tiny random Llama), against a real daemon and SeaweedFS.

Nothing here is simulated: vLLM runs the connector it finds by name through kvbm's plugin entry point,
with its own Worker processes at TP=2; the daemon runs as ``python -m kvbm.cli.serve``. The connector
runs with default settings: it derives how many vLLM blocks make a kvbm block from the daemon.

The oracle is not only the greedy tokens (a tiny random model may agree even with wrong KV): the KV
bytes of every loaded vLLM block, on every TP rank, must equal those of an engine that computed them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from needs import needs
from serve_proc import ServeProc

from kvbm.bench.openai_server import free_port as _free_port
from kvbm.blocks.vllm_hash import vllm_block_hashes
from kvbm.verify.zygote import run_forked

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]
HERE = Path(__file__).parent
VLLM_BS = 128
VBLOCK_BYTES = 64 * 1024  # one vLLM block of the tiny model: 128 tokens x 2 layers x 2 KV heads x 32 x K,V x bf16
PROMPT = [(i * 7 + 3) % 997 + 3 for i in range(2000)]
HASH_SEED = "0"


def free_port() -> int:
    return _free_port()  # not from the kernel's ephemeral range (kvbm.bench.openai_server)


class Daemon(ServeProc):
    """The kvbm daemon on loopback TCP, following the engine's KV events."""

    def __init__(self, tmp: Path, s3, bucket: str, block_bytes: str = "128KiB", **daemon) -> None:
        self.vllm_events = f"tcp://127.0.0.1:{free_port()}"
        super().__init__(tmp, {
            "block_bytes": block_bytes,
            "device": {"enabled": False},
            "host": {"capacity": "4MiB"},
            "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False},
            "s3": {"endpoint": s3.endpoint, "access_key": s3.access_key, "secret_key": s3.secret_key,
                   "bucket": bucket, "prefix": "e2e"},
            "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "metrics_port": 0, "vllm_events": [self.vllm_events], **daemon},
        })

    def stats(self) -> dict:
        with self.client(timeout_s=5) as c:
            return c.stats()

    def resident(self, engine: str) -> set:
        """The engine's GPU-resident block hashes as the daemon knows them from its KV events."""
        from kvbm.ops import DaemonLink

        with DaemonLink(self.endpoint, 5, admin_token=self.admin_token()) as link:  # an admin session
            return set(link.client.stats(resident=True)["engines"][engine]["resident"])

    def wait_cascaded(self, blocks: int) -> dict:
        """Stats once every stored block reached G3 and G4 (generous deadline: a loaded CI machine)."""
        deadline = time.monotonic() + 60
        while True:
            st = self.stats()
            done = st["manager"]["cascade_writes"] >= 2 * blocks and not st["manager"]["pending_cascades"]
            if done or time.monotonic() > deadline:
                return st
            time.sleep(0.5)


def kvbm_cached(prompt_len: int, vllm_bs: int) -> int:
    """The tokens a hit on a stored prompt serves: with partial blocks, every whole vLLM block before the last
    token (a full-block run, then the partial block that continues it), as vLLM's own prefix cache would."""
    return (prompt_len - 1) // vllm_bs * vllm_bs


def kvbm_stored(prompt_len: int, answer: int, vllm_bs: int, k: int) -> int:
    """Blocks one rank stores for a request: its full kvbm blocks and its partial ones (the prompt's tail when
    its prefill ends, the request's when it finishes; one block when both end in the same vLLM block)."""
    computed = prompt_len + answer - 1  # the last sampled token has no KV
    full = computed // vllm_bs // k
    return full + len({v for v in (prompt_len // vllm_bs, computed // vllm_bs) if v % k})


def run_vllm(tmp: Path, name: str, model: str, daemon: ServeProc | None, steps: list[dict], *, tp: int = 1,
             pp: int = 1, prompt: list[int] = PROMPT, digest_blocks: int = 0, events: str | None = None,
             extra: dict | None = None, group_digest_blocks: int = 0, attention_backend: str = "",
             evict_before_load: int = 0, engine: dict | None = None, evict_partial: bool = False) -> list[dict]:
    """One engine in a fresh process; ``daemon`` None runs it without the connector."""
    spec = {"model": model, "prompt": prompt, "steps": steps, "events": events, "tp": tp, "pp": pp,
            "digest_blocks": digest_blocks, "group_digest_blocks": group_digest_blocks,
            "attention_backend": attention_backend, "evict_before_load": evict_before_load, "engine": engine,
            "evict_partial": evict_partial}
    if daemon is not None:
        # Default settings: no vllm_blocks_per_kvbm_block, the connector derives it from the daemon.
        spec["connector"] = {"daemon": daemon.endpoint, "model_name": "tiny-llama-e2e", "timeout_s": 5,
                             **(extra or {})}
        spec["admin_token_file"] = str(daemon.admin_token_path)  # for the evict steps
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": HASH_SEED, "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2" if tp * pp == 1 else "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # EngineCore in the runner: it reads the block table
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    if tp * pp > 1:  # one thread per worker process, each bound to its own core
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp * pp))
    if tp * pp == 1:  # a fork of a pre-imported vLLM (kvbm.verify.zygote): 12 s of imports less per engine
        rc = run_forked("vllm_runner:main", [str(spec_path), str(out_path)], tmp / f"{name}.log", env, 600,
                        preload=("vllm_runner",))
    else:
        with open(tmp / f"{name}.log", "wb") as log:
            rc = subprocess.run([sys.executable, str(HERE / "vllm_runner.py"), str(spec_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
    if rc != 0:
        raise AssertionError(f"vLLM run {name} failed:\n" + (tmp / f"{name}.log").read_text()[-4000:])
    return json.loads(out_path.read_text())["results"]


def tier_hits(stats: dict) -> dict[str, int]:
    return {t["tier"]: t["stats"]["hits"] for t in stats["tiers"]}


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> dict:
    """A vLLM with no connector at all: the reference tokens and KV bytes of the prompt's full blocks."""
    return run_vllm(tmp_path_factory.mktemp("baseline"), "baseline", tiny_model, None, [{}],
                    digest_blocks=len(PROMPT) // VLLM_BS)[0]


def test_connector_end_to_end(tmp_path, tiny_model, baseline, s3_server):
    daemon = Daemon(tmp_path, s3_server, f"kvbm-e2e-{uuid.uuid4().hex[:8]}")
    try:
        daemon.start()
        # The daemon's 128 KiB blocks hold two 64 KiB vLLM blocks: the connector must derive k = 2.
        k = 128 * 1024 // VBLOCK_BYTES
        full_kvbm_blocks = (len(PROMPT) - 1) // (VLLM_BS * k)  # 7 blocks = 1792 tokens
        loaded_vblocks = full_kvbm_blocks * k

        # 1. First engine: computes the prompt, stores its full blocks through kvbm, publishes KV events.
        first = run_vllm(tmp_path, "store", tiny_model, daemon, [{}], events=daemon.vllm_events)[0]
        assert first["tokens"] == baseline["tokens"]
        assert first["kv_transfer_params"]["kvbm"]["degraded"] is False, first["kv_transfer_params"]
        stored = kvbm_stored(len(PROMPT), 8, VLLM_BS, k)  # the full blocks and the prompt's partial one
        st = daemon.wait_cascaded(stored)
        g = {t["tier"]: t for t in st["tiers"]}
        assert g["G3"]["blocks"] == stored and g["G4"]["blocks"] == stored, g

        # 5. The daemon followed the engine's KV events: vLLM's own block hashes are resident on its GPU.
        expected = {int.from_bytes(h[-8:], "big") for h in vllm_block_hashes(PROMPT, VLLM_BS, seed=HASH_SEED)}
        engines = st["engines"]
        assert len(engines) == 1
        view = next(iter(engines.values()))
        assert view["blocks"].get("GPU", 0) >= len(expected) and view["gaps"] == 0, view
        assert expected <= daemon.resident(next(iter(engines)))

        # 2 + 3. A fresh engine: the prefix comes from kvbm (G2), then again from S3 (G4) alone. The loaded
        # vLLM blocks hold exactly the bytes the baseline engine computed.
        before = tier_hits(daemon.stats())
        hit, evicted, hit_g4 = run_vllm(tmp_path, "load", tiny_model, daemon, [{}, {"evict": ["G2", "G3"]}, {}],
                                        digest_blocks=loaded_vblocks)
        ref = baseline["kv_digests"][0][:loaded_vblocks]
        assert hit["num_cached_tokens"] == kvbm_cached(len(PROMPT), VLLM_BS) > full_kvbm_blocks * VLLM_BS * k
        assert hit["tokens"] == baseline["tokens"]
        assert hit["kv_digests"] == [ref]
        assert hit["prefix_cache_reset"] is True  # step 3 cannot be served by vLLM's own prefix cache
        assert evicted["evicted"] == 2 * stored  # one copy in G2, one in G3
        assert hit_g4["num_cached_tokens"] == kvbm_cached(len(PROMPT), VLLM_BS)
        assert hit_g4["tokens"] == baseline["tokens"]
        assert hit_g4["kv_digests"] == [ref]
        after = tier_hits(daemon.stats())
        assert after["G4"] - before["G4"] >= full_kvbm_blocks

        # 4. Daemon gone: the engine recomputes, answers the same, and says the connector is degraded.
        daemon.stop()
        down = run_vllm(tmp_path, "down", tiny_model, daemon, [{}])[0]
        assert down["tokens"] == baseline["tokens"]
        assert down["num_cached_tokens"] == 0
        assert down["kv_transfer_params"]["kvbm"]["degraded"] is True
        assert "unavailable" in (tmp_path / "down.log").read_text()
    finally:
        daemon.stop()


def test_tensor_parallel_2_stores_and_loads_every_rank(tmp_path, tiny_model, s3_server):
    """TP=2 (two worker processes, one thread each): both ranks store, and both load what they stored (the
    same engine, its prefix cache reset and every KV cache poisoned in between: only kvbm can serve it)."""
    prompt = [(i * 11 + 5) % 991 + 3 for i in range(3000)]
    daemon = Daemon(tmp_path, s3_server, f"kvbm-tp2-{uuid.uuid4().hex[:8]}")
    try:
        daemon.start()
        # Per rank a vLLM block is half as big (one KV head of two), so k = 4 against 128 KiB blocks.
        k = 128 * 1024 // (VBLOCK_BYTES // 2)
        full = (len(prompt) - 1) // (VLLM_BS * k)  # 5 blocks of 512 tokens = 2560 tokens
        store, load = run_vllm(tmp_path, "tp2", tiny_model, daemon, [{"settle": True}, {"poison": True}], tp=2,
                               prompt=prompt, digest_blocks=full * k)
        assert store["kv_transfer_params"]["kvbm"]["degraded"] is False, store["kv_transfer_params"]
        stored = kvbm_stored(len(prompt), 8, VLLM_BS, k)
        st = daemon.wait_cascaded(2 * stored)
        assert {t["tier"]: t["blocks"] for t in st["tiers"]}["G2"] == 2 * stored  # each rank its own namespace
        assert load["num_cached_tokens"] == kvbm_cached(len(prompt), VLLM_BS)
        assert load["tokens"] == store["tokens"]
        assert len(load["kv_digests"]) == 2 and load["kv_digests"] == store["kv_digests"]
        assert load["kv_digests"][0] != load["kv_digests"][1]  # the ranks hold different heads
    finally:
        daemon.stop()


def test_daemon_blocks_smaller_than_a_vllm_block_is_a_clear_error(tmp_path, tiny_model, baseline, s3_server):
    """A 64 KiB vLLM block cannot fit 32 KiB kvbm blocks: the engine still answers (recomputing), and the
    connector says why, naming both sizes and the settings to change, once, never "unavailable"."""
    daemon = Daemon(tmp_path, s3_server, f"kvbm-small-{uuid.uuid4().hex[:8]}", block_bytes="32KiB")
    try:
        daemon.start()
        out = run_vllm(tmp_path, "small", tiny_model, daemon, [{}, {}])
        for res in out:
            assert res["tokens"] == baseline["tokens"]
            assert res["num_cached_tokens"] == 0
            kvbm = res["kv_transfer_params"]["kvbm"]
            assert kvbm["degraded"] is True and kvbm["misconfigured"] is True, kvbm
            assert str(VBLOCK_BYTES) in kvbm["reason"] and "32768" in kvbm["reason"], kvbm
            assert "block_bytes" in kvbm["reason"] and "--block-size" in kvbm["reason"], kvbm
        log = (tmp_path / "small.log").read_text()
        assert "unavailable" not in log, log[-3000:]
        warnings = [ln for ln in log.splitlines() if "kvbm:" in ln and "block_bytes" in ln]
        assert len(warnings) == 1, warnings
        assert daemon.stats()["daemon"]["registered"] == 0
    finally:
        daemon.stop()


def test_connector_under_curve_with_a_client_allow_list(tmp_path, tiny_model, s3_server):
    """The connector's CURVE settings (kv_connector_extra_config) reach a daemon that admits only
    allow-listed clients: the engine loads what it stored (its prefix cache reset, its KV caches poisoned in
    between), both through CURVE; an engine without a client key pair is not admitted."""
    from kvbm.client import WorkerClient
    from kvbm.security import load_keypair, write_keypair

    keys = tmp_path / "keys"
    _spub, ssec = write_keypair(keys, "server")
    cpub, csec = write_keypair(keys, "engine")
    (tmp_path / "clients").mkdir()
    (tmp_path / "clients" / "engine.key").write_text(cpub.read_text())
    daemon = Daemon(tmp_path, s3_server, f"kvbm-curve-{uuid.uuid4().hex[:8]}", curve_server_key_file=str(ssec),
                    curve_clients_dir=str(tmp_path / "clients"))
    extra = {"curve_server_key_file": str(keys / "server.key"), "curve_client_key_file": str(csec)}
    k = 128 * 1024 // VBLOCK_BYTES
    try:
        daemon.start()
        store, load = run_vllm(tmp_path, "curve", tiny_model, daemon, [{"settle": True}, {"poison": True}],
                               extra=extra)
        assert store["kv_transfer_params"]["kvbm"]["degraded"] is False, store["kv_transfer_params"]
        with WorkerClient(daemon.endpoint, timeout_s=10, curve_server_key=load_keypair(ssec)[0].decode(),
                          curve_keypair=load_keypair(csec)) as c:
            g2 = {t["tier"]: t["blocks"] for t in c.stats()["tiers"]}["G2"]
        assert g2 == kvbm_stored(len(PROMPT), 8, VLLM_BS, k)
        assert load["num_cached_tokens"] == kvbm_cached(len(PROMPT), VLLM_BS)
        assert load["tokens"] == store["tokens"]
        # The same engine without its key pair: not admitted, so it recomputes and says it is degraded.
        anon = run_vllm(tmp_path, "curve-anon", tiny_model, daemon, [{}],
                        extra={"curve_server_key_file": str(keys / "server.key")})[0]
        assert anon["num_cached_tokens"] == 0 and anon["tokens"] == store["tokens"]
        assert anon["kv_transfer_params"]["kvbm"]["degraded"] is True
    finally:
        daemon.stop()
