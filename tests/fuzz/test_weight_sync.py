"""An RL weight sync on vLLM's in-process engine right after ``LLM.generate`` returned (real vLLM CPU engine,
real daemon; tests/fuzz/weight_sync_engine.py). kvbm used to keep a finished request's blocks until its last
saves ran in the engine's next step (``delay_free``), and the in-process engine does not step after a generate:
``reset_prefix_cache()`` answered False (vLLM's own cache kept the old weights' KV) and ``pause_generation(
clear_cache=True)`` raised ``Failed to reset KV cache`` (verify seed 1137's class). kvbm now holds no finished
request's block: its unread saves are staged before vLLM can reuse the blocks, and nothing is lost."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from needs import needs

from kvbm.verify.harness import HASH_SEED
from kvbm.verify.schedule import VLLM_BLOCK

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]


def test_a_weight_sync_right_after_generate_goes_through_and_the_last_blocks_are_kept(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": HASH_SEED, "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    script = Path(__file__).with_name("weight_sync_engine.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "w"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["held_after_generate"] == 0, res  # was 5 blocks held for the last saves
    assert res["reset_after_generate"] is True, res  # was False: vLLM's own cache not reset
    assert res["pause"] == "ok", res  # was RuntimeError('Failed to reset KV cache ...')
    # The finished request's last blocks, its partial block included, were saved from the staged bytes: the next
    # turn is cached from kvbm as far as vLLM's own cache would (to the vLLM block before its last token) ...
    assert res["turn2_cached"] == (res["turn2_len"] - 1) // VLLM_BLOCK * VLLM_BLOCK, res
    # ... and those bytes are its KV: the same tokens as computing it under a new epoch.
    assert res["reset_connector"] is True and res["turn2_computed_cached"] == 0, res
    assert res["turn2_kvbm"] == res["turn2_computed"], res
    assert len(res["after_pause"]) == 5, res
    # The next turn asked at once (no step after the last one finished) waits for the last turn's saves, staged in
    # the step that starts it: cached from kvbm as far as the first turn above (was: the prompt's blocks only).
    assert res["at_once_cached"] == (res["at_once_len"] - 1) // VLLM_BLOCK * VLLM_BLOCK, res
