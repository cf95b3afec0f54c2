"""An RL loop's weight sync on vLLM's in-process engine (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
RL frameworks run it) over a real daemon: ``python weight_sync_engine.py ROOT OUT``. Writes what each step saw
as JSON for tests/fuzz/test_weight_sync.py."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from kvbm.verify.daemon import VerifyDaemon
from kvbm.verify.engine import make_llm
from kvbm.verify.harness import write_model
from kvbm.verify.schedule import Engine, Schedule


def held_blocks(llm: Any) -> int:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def drain(llm: Any) -> None:
    """Step until the connector's saves are in the daemon (kvbm.integrations.vllm.drain), or fail the run."""
    from kvbm.integrations.vllm.drain import drain as drained

    if not drained(llm):
        raise RuntimeError("the connector's saves did not end")


def main(root: Path, out: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    root.mkdir(parents=True, exist_ok=True)
    daemon = VerifyDaemon(root / "daemon")
    daemon.start()
    res: dict[str, Any] = {}
    try:
        sched = Schedule(seed=-1, model="llama", requests=[], ops=[],
                         engine=Engine(num_gpu_blocks=30, max_num_seqs=4, async_load=False, async_save=True))
        llm = make_llm(write_model(root), sched, daemon, load=True)
        rng = random.Random(7)

        def gen(tokens: list[int], n: int = 40) -> tuple[list[int], int]:
            o = llm.generate([TokensPrompt(prompt_token_ids=tokens)],
                             SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)[0]
            return list(o.outputs[0].token_ids), o.num_cached_tokens or 0

        first = [rng.randint(10, 900) for _ in range(700)]
        out1, _ = gen(first)
        res["held_after_generate"] = held_blocks(llm)
        res["reset_after_generate"] = llm.reset_prefix_cache()  # vLLM's own cache: the next turn is kvbm's
        drain(llm)
        turn2 = first + out1 + [rng.randint(10, 900) for _ in range(10)]
        res["turn2_len"] = len(turn2)
        res["turn2_kvbm"], res["turn2_cached"] = gen(turn2, 20)
        res["reset_connector"] = llm.reset_prefix_cache(reset_connector=True)  # new weights epoch: computed
        res["turn2_computed"], res["turn2_computed_cached"] = gen(turn2, 20)
        # A weight sync right after a generate: abort everything and clear the caches, with no step between.
        gen([rng.randint(10, 900) for _ in range(300)], 30)
        res["held_before_pause"] = held_blocks(llm)
        core = llm.llm_engine.engine_core.engine_core
        try:
            core.pause_scheduler(mode="abort", clear_cache=True)
            res["pause"] = "ok"
        except Exception as e:  # vLLM raises "Failed to reset KV cache" while blocks are held
            res["pause"] = repr(e)
        core.resume_scheduler()
        res["after_pause"], _ = gen(first[:200], 5)
        # A conversation's next turn at once, no step in between: the finished turn's last blocks are staged in the
        # step that starts the next one, after its lookup was answered.
        drain(llm)
        c = [rng.randint(10, 900) for _ in range(700)]
        out_c, _ = gen(c, 69)  # its last step completes the vLLM block of tokens 640-767: saved only as a final
        llm.reset_prefix_cache()  # vLLM's own cache: the next turn is kvbm's
        at_once = c + out_c + [rng.randint(10, 900) for _ in range(10)]
        res["at_once_len"] = len(at_once)
        res["at_once"], res["at_once_cached"] = gen(at_once, 20)
    finally:
        daemon.stop()
    out.write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
