"""Loads through a real vLLM (CPU build) and a real daemon, in the shapes that used to lose their hit."""

from __future__ import annotations

import importlib.util

import pytest
from needs import needs
from serve_proc import ServeProc
from test_vllm_e2e import run_vllm
from test_vllm_layouts import free_port, g2_daemon
from test_vllm_preemption import BLOCK_TOKENS, K

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]


def test_a_load_longer_than_the_sessions_slot_budget_is_loaded_in_pieces(tmp_path, tiny_model):
    """A daemon that lets a session hold 2 G2 slots at once, a prompt of 4 stored kvbm blocks: the load is
    onboarded 2 blocks at a time (it used to be one Onboard of 4, refused ``full``: a whole miss). The load is
    the only source (the engine's KV caches poisoned first) and brings the bytes the first step computed."""
    prompt = [(i * 31 + 7) % 971 + 3 for i in range(1100)]
    full = (len(prompt) - 1) // BLOCK_TOKENS
    assert full == 4
    daemon = ServeProc(tmp_path, {
        "block_bytes": "128KiB", "device": {"enabled": False}, "host": {"capacity": "8MiB"},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                   "metrics_port": -1, "max_session_slots": 2},
    })
    try:
        daemon.start()
        first, second = run_vllm(tmp_path, "split", tiny_model, daemon, [{"settle": True}, {"poison": True}],
                                 prompt=prompt, digest_blocks=full * K)
        with daemon.client(timeout_s=5) as c:
            m = c.stats()["manager"]
        assert second["num_cached_tokens"] == full * BLOCK_TOKENS, (second["num_cached_tokens"], m)
        assert m["onboards"] >= 2 and m["onboard_blocks"] == full, m
        assert second["kv_digests"] == first["kv_digests"]
        assert second["tokens"] == first["tokens"]
    finally:
        daemon.stop()


def test_with_sync_saves_the_blocks_a_request_completes_in_its_last_step_are_saved(tmp_path, tiny_model):
    """``async_save: false``: the blocks completed in a request's last step (with async scheduling, the step
    whose token was not appended yet when its saves were planned) used to be saved only with async saves, so
    a sync-save engine never stored a request's last block. A prompt whose last kvbm block fills with the
    answer's last computed token: the next request with those tokens loads every block."""
    bs = BLOCK_TOKENS
    prompt = [(i * 37 + 11) % 967 + 3 for i in range(4 * bs - 4)]
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        first, second = run_vllm(tmp_path, "sync", tiny_model, daemon,
                                 [{"settle": True, "max_tokens": 5},
                                  {"poison": True, "follow_up": [5, 6, 7], "max_tokens": 2}],
                                 prompt=prompt, extra={"async_save": False}, engine={"async_scheduling": True})
        assert first["prompt_tokens"] + len(first["tokens"]) == 4 * bs + 1
        assert second["num_cached_tokens"] == 4 * bs, (second["num_cached_tokens"], 4 * bs)
    finally:
        daemon.stop()


@pytest.mark.parametrize("async_load", [True,
    False], ids=["async-load", "sync-load"])
def test_requests_preempted_and_admitted_again_in_one_step_load_and_finish(tmp_path, tiny_model, async_load):
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request and the next step
    admits them again, with a kvbm hit each. The connector took the preemption for the new admission's and
    dropped its planned load: an async load was never started (the request waited for ever), a sync one left
    its blocks unloaded. Every request finishes, with the tokens it gets with no reset at all."""
    prefix = [(i * 41 + 13) % 959 + 3 for i in range(4 * BLOCK_TOKENS)]
    batch = [prefix + [(i * 7 + r) % 900 + 3 for i in range(20)] for r in range(2)]
    plan = {"batch": batch, "max_tokens": 12, "reset_after": 3}
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        extra = {"async_load": async_load}
        _, reset, again = run_vllm(tmp_path, "reset", tiny_model, daemon,
                                   [{"settle": True, "max_tokens": 1}, {"stepped": plan},
                                    {"stepped": {**plan, "reset_after": -1}}], prompt=prefix, extra=extra)
        assert not reset["stuck"], f"requests never finished in {reset['seconds']} s ({reset['steps']} steps)"
        assert reset["resets"] == 1
        assert reset["batch_tokens"] == again["batch_tokens"]
        assert all(len(t) == 12 for t in reset["batch_tokens"])
    finally:
        daemon.stop()


def test_a_conversations_next_turn_is_cached_to_the_vllm_block_and_computes_the_same_tokens(tmp_path, tiny_model):
    """Turn 1 (prompt + answer) ends inside a kvbm block: its tokens past the last full kvbm block are saved as
    a partial block. Turn 2 (turn 1, its answer, a new question) after vLLM's own cache is reset and its KV
    poisoned: kvbm serves every full block and the partial one, so the tokens cached reach the last vLLM block
    before the new question (they stopped at the last full kvbm block, up to k - 1 vLLM blocks short), and turn
    2's tokens are those an engine computing everything gets."""
    prompt = [(i * 43 + 17) % 953 + 3 for i in range(1100)]
    answer, question = 60, [(i * 5 + 1) % 900 + 3 for i in range(20)]
    turn2_len = len(prompt) + answer + len(question)
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        steps = [{"settle": True, "max_tokens": answer}, {"poison": True, "follow_up": question, "max_tokens": 8}]
        first, second = run_vllm(tmp_path, "conv", tiny_model, daemon, steps, prompt=prompt)
        alone1, alone2 = run_vllm(tmp_path, "alone", tiny_model, None,
                              [{"max_tokens": answer}, {"follow_up": question, "max_tokens": 8}], prompt=prompt)
        assert second["prompt_tokens"] == turn2_len
        vllm_bs = BLOCK_TOKENS // K
        computed = len(prompt) + answer - 1  # turn 1's tokens with KV (its last sampled token has none)
        want = computed // vllm_bs * vllm_bs
        assert want % BLOCK_TOKENS, "turn 1 must end inside a kvbm block for the test to mean anything"
        assert second["num_cached_tokens"] == want, (second["num_cached_tokens"], want)
        assert first["tokens"] == alone1["tokens"]
        assert second["tokens"] == alone2["tokens"]
    finally:
        daemon.stop()


def test_a_local_hit_ending_inside_a_kvbm_block_is_continued_from_kvbm(tmp_path, tiny_model):
    """vLLM's own prefix cache holds the prompt's first 3 vLLM blocks (another request computed them): its hit
    ends inside the second kvbm block (2 vLLM blocks each). kvbm used to give up on such a request (its lookup
    asked only from a kvbm block boundary) and the 5 vLLM blocks after the hit were computed; now the second
    block loads only its vLLM block past the hit and the rest load whole: every stored block is used, and the
    tokens are those an engine computing everything gets."""
    prompt = [(i * 29 + 5) % 947 + 3 for i in range(4 * BLOCK_TOKENS + 20)]
    vbs = BLOCK_TOKENS // K
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        steps = [{"settle": True, "max_tokens": 1},
                 {"prompt": prompt[: 3 * vbs + 5], "max_tokens": 1, "keep_prefix_cache": True, "settle": True},
                 {"prompt": prompt, "max_tokens": 8}]
        _, local, hit = run_vllm(tmp_path, "local", tiny_model, daemon, steps, prompt=prompt)
        (alone,) = run_vllm(tmp_path, "alone", tiny_model, None, [{"max_tokens": 8}], prompt=prompt)
        assert local["prefix_cache_reset"] is None  # vLLM kept the 3 blocks for the next request
        assert hit["num_cached_tokens"] == 4 * BLOCK_TOKENS, (hit["num_cached_tokens"], hit["kv_transfer_params"])
        assert hit["tokens"] == alone["tokens"]
    finally:
        daemon.stop()


def test_a_prompt_ending_on_a_vllm_block_inside_a_kvbm_block_loads_all_but_that_vllm_block(tmp_path, tiny_model):
    """A prompt of 3 kvbm blocks of 4 vLLM blocks and 3 more vLLM blocks, exactly (issue 40's 6,016-token prompt:
    47 vLLM blocks of 128 at 4 per kvbm block). Its first run stores the 3 full blocks and a partial block of its
    last 3 vLLM blocks. vLLM must compute the last prompt token, so a second run may load 14 vLLM blocks: the lookup
    asked only for partial blocks of up to 2 and found none, so it cached 12 (1,536 of the 6,016-token prompt's
    tokens computed again, against vLLM's own hit's 128). Now the stored partial block's head loads: cached to the
    last vLLM block, as vLLM's own hit, with the first run's KV bytes (caches poisoned: kvbm is the only source) and
    tokens."""
    k = 4
    vbs = BLOCK_TOKENS // K
    prompt = [(i * 53 + 11) % 941 + 3 for i in range((3 * k + 3) * vbs)]
    daemon = g2_daemon(tmp_path, block_bytes="256KiB")  # 4 of the tiny model's 64 KiB vLLM blocks
    try:
        daemon.start()
        first, second = run_vllm(tmp_path, "vedge", tiny_model, daemon, [{"settle": True}, {"poison": True}],
                                 prompt=prompt, digest_blocks=3 * k + 2)
        assert second["num_cached_tokens"] == len(prompt) - vbs, (second["num_cached_tokens"], len(prompt) - vbs)
        assert second["kv_digests"] == first["kv_digests"]
        assert second["tokens"] == first["tokens"]
    finally:
        daemon.stop()


def test_a_prompt_ending_on_a_kvbm_block_boundary_loads_all_but_its_last_vllm_block(tmp_path, tiny_model):
    """A prompt of exactly 4 kvbm blocks (2 vLLM blocks each), stored by a first run. vLLM must compute the last
    prompt token, so the last kvbm block cannot load whole: the connector used to load 3 blocks and compute the
    whole 4th (k vLLM blocks); vLLM's own prefix cache computes only its last vLLM block. Now the 4th stored block
    loads all but its last vLLM block: cached to the last vLLM block, as vLLM's own hit, with the KV bytes (the
    engine's caches poisoned first: kvbm is the only source) and tokens of the first run."""
    prompt = [(i * 47 + 19) % 941 + 3 for i in range(4 * BLOCK_TOKENS)]
    vbs = BLOCK_TOKENS // K
    daemon = g2_daemon(tmp_path)
    try:
        daemon.start()
        first, second = run_vllm(tmp_path, "edge", tiny_model, daemon, [{"settle": True}, {"poison": True}],
                                 prompt=prompt, digest_blocks=4 * K - 1)
        assert second["num_cached_tokens"] == len(prompt) - vbs, (second["num_cached_tokens"], len(prompt) - vbs)
        assert second["kv_digests"] == first["kv_digests"]
        assert second["tokens"] == first["tokens"]
    finally:
        daemon.stop()
