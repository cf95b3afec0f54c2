"""A serving bench's requests: reproducible prompts, batches of streamed completions with C in flight, their
summary (TTFT, e2e, ITL, throughput, cached tokens), and the telling error line of a server's log."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Sequence
from typing import Any

from kvbm.bench.common import percentile
from kvbm.bench.openai_server import FIRST_WORD, Completion, stream_completion, words


class Prompts:
    """Random word prompts (token ids >= FIRST_WORD), reproducible from the seed."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_WORD, self.vocab) for _ in range(n)]



async def run_batch(cli: Any, model: str, prompts: Sequence[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[Completion], float]:
    """Send ``prompts`` in order, at most ``concurrency`` in flight; the completions and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> Completion:
        async with sem:
            return await stream_completion(cli, model, words(p), max_tokens)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return list(outs), time.perf_counter() - t0


def phase_summary(outs: list[Completion], wall_s: float) -> dict[str, Any]:
    ok = [c for c in outs if c.error is None and c.ttft_s is not None]
    ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
    e2e = [c.e2e_s for c in ok]
    itl = [x for c in ok for x in c.itl_s]

    def stats(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        return {"mean": round(sum(xs) / len(xs), 4), "p50": round(percentile(xs, 50), 4),
                "p95": round(percentile(xs, 95), 4), "max": round(max(xs), 4)}

    return {
        "requests": len(outs), "errors": [c.error for c in outs if c.error][:5], "n_errors": len(outs) - len(ok),
        "wall_s": round(wall_s, 2), "ttft_s": stats(ttft), "e2e_s": stats(e2e), "itl_s": stats(itl),
        "request_throughput": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "output_tokens_per_s": round(sum(c.completion_tokens for c in ok) / wall_s, 2) if wall_s else 0.0,
        "total_tokens_per_s": round(sum(c.completion_tokens + c.prompt_tokens for c in ok) / wall_s, 1)
        if wall_s else 0.0,
        "cached_tokens_mean": round(sum(c.cached_tokens or 0 for c in ok) / len(ok), 1) if ok else 0.0,
        "prompt_tokens_mean": round(sum(c.prompt_tokens for c in ok) / len(ok), 1) if ok else 0.0,
    }


GENERIC_ERRORS = ("See root cause above", "Failed core proc", "EngineDeadError", "Exception caught")


def error_line(log: str) -> str:
    """The most telling error line of a server log: the last ``SomethingError: ...`` line that is not a wrapper
    pointing elsewhere ("Engine core initialization failed. See root cause above")."""
    lines = [ln.strip() for ln in log.splitlines() if re.search(r"\b\w+(Error|Exception)\b: ", ln)]
    roots = [ln for ln in lines if not any(g in ln for g in GENERIC_ERRORS)]
    pick = roots or lines
    if pick:
        return pick[-1][-400:]
    return log.strip().splitlines()[-1][-400:] if log.strip() else ""

