"""A kvbm hit against vLLM's own prefix-cache hit and a full compute, prompt by prompt, in one engine.

A hit computes a prompt's last tokens over cached KV: another kernel shape than the full prefill that stored it,
so in bf16 its logits round differently, and on a near tie the first token flips (a tiny random model then goes
on with the computed chain one token ahead). That is the hit's numerics, not wrong KV, and vLLM's own prefix
cache has it too: the oracle for a hit's tokens is vLLM's own hit of the same cached tokens (the same bytes, the
same shape), which kvbm's hit must equal token for token. ``python -m kvbm.verify.numerics SPEC OUT`` runs it;
:func:`run` spawns that process (EngineCore in process, a G2-only daemon of its own).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvbm.verify.daemon import VerifyDaemon
from kvbm.verify.engine import HASH_SEED


def write_model(root: Path, layers: int) -> str:
    """A tiny random Llama of ``layers`` layers (its dtype is the engine's)."""
    path = root / f"tiny-llama-{layers}l"
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=4096)).save_pretrained(path)
    return str(path)


def run(root: Path, *, prompts: int, dtype: str, seed: int = 0, layers: int = 8, max_tokens: int = 24,
        timeout_s: float = 3600) -> dict[str, Any]:
    """Spawn the engine process; its report."""
    root.mkdir(parents=True, exist_ok=True)
    spec = {"root": str(root), "prompts": prompts, "dtype": dtype, "seed": seed, "layers": layers,
            "max_tokens": max_tokens}
    spec_path, out = root / "numerics.spec.json", root / "numerics.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": HASH_SEED, "OMP_NUM_THREADS": "2",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = root / "numerics.log"
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "kvbm.verify.numerics", str(spec_path), str(out)],
                              stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the numerics engine failed (exit {proc.returncode}): {log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _compare(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kvbm.integrations.vllm.drain import drain
    from kvbm.verify.harness import describe_tokens

    root = Path(spec["root"])
    daemon = VerifyDaemon(root / "daemon")
    daemon.start()
    try:
        llm = LLM(model=write_model(root, spec["layers"]), enforce_eager=True, enable_prefix_caching=True,
                  skip_tokenizer_init=True, dtype=spec["dtype"], seed=0, max_model_len=3000, block_size=32,
                  num_gpu_blocks_override=400,
                  kv_transfer_config={"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"daemon": daemon.endpoint,
                                                                    "model_name": "kvbm-numerics"}})
        params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0.0, detokenize=False)

        def gen(prompt: list[int]) -> tuple[list[int], int]:
            o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)

        def reset() -> None:  # once kvbm's saves landed (a reset is no barrier for them), vLLM's own cache
            drain(llm)
            for _ in range(1000):
                if llm.reset_prefix_cache():
                    return
                llm.llm_engine.step()
                time.sleep(0.01)
            raise RuntimeError("vLLM refused to reset its prefix cache for 10 s")

        rng = random.Random(spec["seed"])
        rows: list[dict[str, Any]] = []
        for _ in range(spec["prompts"]):
            prompt = [rng.randint(3, 990) for _ in range(rng.randint(600, 1500))]
            reset()
            full, _ = gen(prompt)  # computed whole (kvbm stores it)
            own, own_cached = gen(prompt)  # vLLM's own prefix-cache hit
            reset()
            hit, kvbm_cached = gen(prompt)  # kvbm's hit: vLLM's cache is empty
            rows.append({"prompt_tokens": len(prompt), "own_cached": own_cached, "kvbm_cached": kvbm_cached,
                         "full": full, "own": own, "kvbm": hit})
    finally:
        daemon.stop()
    n = len(rows)
    report: dict[str, Any] = {
        "dtype": spec["dtype"], "layers": spec["layers"], "prompts": n, "max_tokens": spec["max_tokens"],
        "same_cached_tokens": sum(r["own_cached"] == r["kvbm_cached"] for r in rows),
        "kvbm_hits": sum(r["kvbm_cached"] > 0 for r in rows),
        "own_hit_differs_from_full": sum(r["own"] != r["full"] for r in rows),
        "kvbm_hit_differs_from_full": sum(r["kvbm"] != r["full"] for r in rows),
        "kvbm_hit_differs_from_own_hit": sum(r["kvbm"] != r["own"] for r in rows),
        "differences": [{"prompt_tokens": r["prompt_tokens"], "cached": [r["own_cached"], r["kvbm_cached"]],
                         "own_vs_full": describe_tokens(r["own"], r["full"], ("vLLM's own hit", "computed"))
                         if r["own"] != r["full"] else None,
                         "kvbm_vs_own": describe_tokens(r["kvbm"], r["own"], ("kvbm", "vLLM's own hit"))
                         if r["kvbm"] != r["own"] else None,
                         "first_diff_vs_full": _first_diff(r["kvbm"], r["full"])}
                        for r in rows if r["own"] != r["full"] or r["kvbm"] != r["own"]],
    }
    return report


if __name__ == "__main__":
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "the comparison steps an in-process EngineCore"
    spec_in = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(_compare(spec_in)))
