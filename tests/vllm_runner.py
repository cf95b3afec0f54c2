"""Runs a real vLLM (CPU build) for tests/test_vllm_e2e.py; one JSON spec in, one JSON result out.

Not a test module: the end-to-end test starts it in a fresh process per engine (vLLM spawns its
EngineCore and Worker processes, hence the __main__ guard).
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    kw = dict(model=spec["model"], enforce_eager=True, enable_prefix_caching=spec.get("prefix_caching", False),
              skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=4, seed=0)
    if spec.get("connector"):
        kw["kv_transfer_config"] = {
            "kv_connector": "KvbmConnector", "kv_connector_module_path": "kvbm.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": spec["connector"],
        }
    if spec.get("events"):
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec["events"],
                                  "topic": "kv"}
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    results = []
    for step in spec["steps"]:
        if step.get("evict"):
            from kvbm.client import WorkerClient
            from kvbm.integrations.vllm import layout_for

            cfg = llm.llm_engine.vllm_config
            extra = spec["connector"]
            lay = layout_for(cfg, 0, cfg.cache_config.block_size * extra.get("vllm_blocks_per_kvbm_block", 1),
                             extra["model_name"])
            with WorkerClient(extra["daemon"], timeout_s=10) as c:
                c.register(lay, worker_id="e2e-evictor")
                removed = c.evict(namespace=lay.namespace, tiers=step["evict"]).removed
            results.append({"evicted": removed})
            continue
        out = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)[0]
        results.append({
            "tokens": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
        })
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
