"""A seeded schedule of engine operations: the same seed always yields the same schedule.

A schedule is data (msgspec structs, JSON on the wire to the engine process): the engine's settings, the
requests with their arrival steps, and the operations between steps. Requests share prefixes (system prompts)
and some are the next turn of an earlier one (its prompt, its answer and a question: the answer is only known
when the engine ran, so the engine process builds that prompt). The KV cache is small enough that vLLM preempts.

Why ``random.Random`` and not hypothesis: each example is an engine in a fresh process (20-40 s to start on a
CPU) plus a clean reference engine, so hypothesis's shrinking (tens of re-runs per failure) does not fit the
budget; a seed replays the schedule exactly and its report names the request that went wrong.
"""

from __future__ import annotations

import random

import msgspec

VOCAB = (3, 990)  # token ids drawn from this range (the tiny model's vocabulary is 1,000)
VLLM_BLOCK = 128  # tokens per vLLM block (the CPU build's default)
GROUPS = {"gemma2": 2}  # KV-cache groups of the models with more than one


class Request(msgspec.Struct, frozen=True):
    id: str
    arrival: int  # the engine step before which it is added
    prompt: list[int]  # a follow-up's own question: its prompt is the parent's prompt + answer + this
    max_tokens: int
    follow_up_of: str | None = None  # the request whose prompt and answer this one re-sends
    reset_before: bool = False  # reset vLLM's prefix cache (running requests too) just before adding it: a hit
    # can then only come from kvbm, and the running requests are preempted and resumed


class Op(msgspec.Struct, frozen=True):
    step: int
    kind: str  # see OP_KINDS
    arg: int = 0  # abort: which live request (index mod count); pause/daemon faults: steps until resumed


OP_KINDS = ("abort", "abort_loading", "reset_prefix_cache", "reset_running", "reset_connector", "pause_abort",
            "pause_keep", "daemon_stop", "daemon_kill")
# Directed schedules also have (never drawn, so every seed keeps its schedule) pause_loading, a pause_abort held back
# until a request waits for its async load, and settle, which steps until the saves so far are in the daemon.


class Engine(msgspec.Struct, frozen=True):
    num_gpu_blocks: int
    max_num_seqs: int
    async_load: bool
    async_save: bool
    groups: int = 1  # KV-cache groups: they share the block pool (vLLM sizes each request's need per group)

    @property
    def max_model_len(self) -> int:
        # vLLM keeps one block back (the null block) and checks that one request of this length fits
        return (self.num_gpu_blocks - 1) // self.groups * VLLM_BLOCK


class Schedule(msgspec.Struct, frozen=True):
    seed: int
    model: str  # "llama" (one KV-cache group) or "gemma2" (a sliding-window group and a full-attention one)
    engine: Engine
    requests: list[Request]
    ops: list[Op]

    def op_counts(self) -> dict[str, int]:
        out: dict[str, int] = {"request": len(self.requests),
                               "follow_up": sum(r.follow_up_of is not None for r in self.requests),
                               "reset_before_request": sum(r.reset_before for r in self.requests)}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + 1
        return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*VOCAB) for _ in range(n)]


def generate(seed: int, *, faults: bool = True, model: str = "llama") -> Schedule:
    """The schedule of ``seed``; ``faults`` False leaves out daemon SIGSTOP/SIGKILL (a quicker, quieter run).
    The model is a dimension of its own: the same seed is the same schedule on each model."""
    rng = random.Random(seed)
    groups = GROUPS.get(model, 1)
    engine = Engine(num_gpu_blocks=rng.randint(12, 20) * groups, max_num_seqs=rng.randint(2, 6),
                    async_load=rng.random() < 0.5, async_save=rng.random() < 0.75, groups=groups)
    limit = engine.max_model_len - 1
    systems = [_tokens(rng, rng.randint(130, 700)) for _ in range(rng.randint(1, 3))]
    requests: list[Request] = []
    horizon = rng.randint(4, 30)  # arrivals spread over this many steps
    for i in range(rng.randint(5, 10)):
        reset = rng.random() < 0.5
        parent = requests[rng.randrange(len(requests))] if requests and rng.random() < 0.3 else None
        question = _tokens(rng, rng.randint(5, 120))
        if parent is not None and parent.follow_up_of is None:
            used = len(parent.prompt) + parent.max_tokens + len(question)
            if used + 8 <= limit:
                max_tokens = rng.randint(4, min(120, limit - used))
                requests.append(Request(f"r{i}", max(parent.arrival, rng.randint(0, horizon)) + 1, question,
                                        max_tokens, follow_up_of=parent.id, reset_before=reset))
                continue
        prefix = rng.choice(systems) if rng.random() < 0.8 else []
        prompt = prefix + _tokens(rng, rng.randint(10, 400))
        firsts = [q for q in requests if q.follow_up_of is None]
        if firsts and rng.random() < 0.2:  # the same prompt again (a retry, a regenerated answer)
            prompt = list(rng.choice(firsts).prompt)
        prompt = prompt[: limit - 8]
        max_tokens = rng.randint(4, min(160, limit - len(prompt)))
        requests.append(Request(f"r{i}", rng.randint(0, horizon), prompt, max_tokens, reset_before=reset))
    kinds = list(OP_KINDS if faults else OP_KINDS[:-2])
    weights = [3, 3, 2, 2, 2, 1, 1, 1, 1][: len(kinds)]
    ops = [Op(rng.randint(1, horizon + 60), k, rng.randint(1, 12))
           for k in rng.choices(kinds, weights, k=rng.randint(2, 10))]
    ops.sort(key=lambda o: o.step)
    return Schedule(seed, model, engine, requests, ops)
