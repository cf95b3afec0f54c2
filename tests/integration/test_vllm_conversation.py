"""A conversation through a real vLLM (CPU build) and a real daemon: every full block of a turn, its prompt and
its answer, is saved, so the next turn (which re-sends both) loads them all from kvbm."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
from needs import needs
from test_vllm_e2e import VBLOCK_BYTES, VLLM_BS, Daemon, run_vllm

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]


# (prompt, answer) tokens: a block completed 63 tokens before the end (1,000 + 344 - 1 = 1,280 + 63), and one
# completed by the last step (1,000 + 281 - 1 = 1,280 = 5 blocks of 256): the answer's last block used to be lost
# (4 of 5 cached).
@pytest.mark.parametrize("prompt_len,answer", [(1000, 344), (1000, 281)])
def test_the_next_turn_of_a_conversation_loads_the_answer_too(tmp_path, tiny_model, s3_server, prompt_len, answer):
    daemon = Daemon(tmp_path, s3_server, f"kvbm-chat-{uuid.uuid4().hex[:8]}")
    k = 128 * 1024 // VBLOCK_BYTES  # 2 vLLM blocks of 128 tokens per kvbm block
    block_tokens = k * VLLM_BS
    prompt = [(i * 13 + 7) % 983 + 3 for i in range(prompt_len)]
    question = [(i * 5 + 1) % 977 + 3 for i in range(50)]
    try:
        daemon.start()
        # Turn 1, then (vLLM's own prefix cache reset after each turn) turn 2 = turn 1 + its answer + a question.
        turn1, turn2 = run_vllm(tmp_path, "chat", tiny_model, daemon,
                                [{"max_tokens": answer, "settle": True}, {"follow_up": question, "max_tokens": 8}],
                                prompt=prompt)
        assert len(turn1["tokens"]) == answer and turn1["prefix_cache_reset"] is True
        assert turn2["prompt_tokens"] == len(prompt) + answer + len(question)
        # Every kvbm block whose tokens all had KV computed in turn 1: the prompt and the answer but its last
        # token (sampled, never fed back). Prompt blocks alone would be (len(prompt) - 1) // block_tokens = 3.
        possible = (len(prompt) + answer - 1) // block_tokens * block_tokens
        print(f"turn 2: {turn2['num_cached_tokens']} cached tokens from kvbm, {possible} possible")
        assert turn2["num_cached_tokens"] == possible
        assert turn2["kv_transfer_params"]["kvbm"]["degraded"] is False
    finally:
        daemon.stop()
