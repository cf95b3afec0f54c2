"""The schedule generator: a seed replays its schedule exactly, and schedules stay inside the engine they name."""

from __future__ import annotations

import msgspec

from kvbm.verify.schedule import OP_KINDS, generate


def test_a_seed_replays_its_schedule_exactly_and_other_seeds_differ():
    a, b = generate(17), generate(17)
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    others = {msgspec.json.encode(generate(s)) for s in range(20)}
    assert len(others) == 20


def test_every_request_fits_the_engine_and_every_op_kind_is_drawn():
    kinds: set[str] = set()
    follow_ups = shared = 0
    for seed in range(200):
        s = generate(seed)
        by_id = {r.id: r for r in s.requests}
        firsts = [r.prompt[:130] for r in s.requests if r.follow_up_of is None]
        shared += len(firsts) != len({tuple(p) for p in firsts})
        for r in s.requests:
            length = len(r.prompt) + r.max_tokens
            if r.follow_up_of is not None:
                parent = by_id[r.follow_up_of]
                assert parent.follow_up_of is None
                length += len(parent.prompt) + parent.max_tokens
                follow_ups += 1
            assert length <= s.engine.max_model_len, (seed, r.id)
        kinds.update(o.kind for o in s.ops)
    assert kinds == set(OP_KINDS)
    assert follow_ups > 50 and shared > 100  # conversations and system prompts are common, not corner cases
    assert all(o.kind not in ("daemon_stop", "daemon_kill") for s in range(50) for o in generate(s, faults=False).ops)


def test_the_model_is_a_dimension_of_its_own():
    """The same seed is the same requests and operations on each model; a hybrid model's KV cache has a block
    pool per group's worth, so vLLM accepts the same longest request."""
    from kvbm.verify.schedule import generate

    for seed in range(20):
        llama, gemma = generate(seed), generate(seed, model="gemma2")
        assert (gemma.requests, gemma.ops, gemma.model) == (llama.requests, llama.ops, "gemma2")
        assert gemma.engine.num_gpu_blocks == 2 * llama.engine.num_gpu_blocks
        assert gemma.engine.max_model_len == llama.engine.max_model_len
