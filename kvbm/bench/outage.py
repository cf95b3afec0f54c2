"""The daemon killed under a serving vLLM: what the engine's users see (``python -m kvbm.bench.outage``).

vLLM's OpenAI server runs with the KvbmConnector against ``kvbm serve``. One request decodes a long answer
(streamed); the daemon gets SIGKILL or SIGSTOP in the middle (or nothing, the control), alone or while new
requests are prefilled. Measured per phase: the time kvbm's connector hooks held each engine step (histograms,
``KVBM_HOOK_TIMES_DIR``), the
decoding stream's longest gap between two tokens before and during the fault, the new requests' time to
first token against the same prompts' cold compute with the daemon up (a miss), and whether hits resume
once the daemon is back (no vLLM restart). One JSON document; medians where there are several.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from kvbm.bench.common import DaemonProc
from kvbm.bench.openai_server import (
    FIRST_WORD,
    KVBM_CONNECTOR,
    Completion,
    ModelSpec,
    VllmServer,
    client,
    free_port,
    native_dtype,
    server_command,
    stream_completion,
    words,
    write_model,
)


async def stream_decode(cli: Any, model: str, prompt: str, n: int, started: asyncio.Event,
                        times: list[float]) -> None:
    """Stream a greedy completion of up to ``n`` tokens (until cancelled), appending the wall-clock arrival of
    each text chunk to ``times``; ``started`` is set at the first."""
    stream = await cli.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0.0, stream=True,
                                          extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.time())
            started.set()


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens whose later token arrived in [start, end)."""
    return [b - a for a, b in pairwise(times) if start <= b < end]


def hook_files(root: Path) -> dict[str, dict[str, Any]]:
    """The connector's hook-time snapshots (``KVBM_HOOK_TIMES_DIR``), by file name (side and pid)."""
    out = {}
    for f in sorted(root.glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            out[f.stem] = json.loads(f.read_text())
    return out


def hook_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per side, the engine steps of an interval: how many, how many kvbm held past its threshold, and per
    hook the interval's histogram (bucket counts) with the upper bound of its slowest bucket."""
    out: dict[str, Any] = {}
    for name, snap in after.items():
        old = before.get(name, {})
        bounds = snap["bounds_ms"]

        def diff(cur: dict[str, Any], prev: dict[str, Any] | None, bounds: list[float] = bounds) -> dict[str, Any]:
            b = [x - y for x, y in zip(cur["buckets"], (prev or {}).get("buckets", [0] * len(cur["buckets"])),
                                       strict=True)]
            top = max((i for i, n in enumerate(b) if n), default=None)
            return {"count": sum(b), "buckets": b,
                    "slowest_bucket_le_ms": None if top is None else (bounds[top] if top < len(bounds) else "inf")}

        out[snap["side"] + ("" if snap["side"] == "scheduler" else f"-{name.split('-')[-1]}")] = {
            "steps": diff(snap["step"], old.get("step")),
            "slow_steps": snap["slow_steps"] - old.get("slow_steps", 0),
            "hooks": {h: diff(v, old.get("hooks", {}).get(h)) for h, v in snap["hooks"].items()}}
    return out


async def run(root: Path, prompt_words: int, decode_tokens: int, arrivals: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    spec = ModelSpec(max_len=8192, dtype=native_dtype())  # 200-token decode prompt + up to 6,000 tokens

    def prompt(n: int = prompt_words) -> str:
        return words([rng.randrange(FIRST_WORD, spec.vocab) for _ in range(n)])

    model = write_model(root / "model", spec)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = DaemonProc(root / "daemon", {
        "block_bytes": "256KiB", "device": {"enabled": False}, "host": {"capacity": "64MiB"},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": endpoint, "events_endpoint": f"tcp://127.0.0.1:{free_port()}", "metrics_port": -1,
                   "admin_token_file": str(root / "admin.token")}})
    connector = {**KVBM_CONNECTOR, "kv_connector_extra_config": {"daemon": endpoint}}  # defaults otherwise
    cmd = server_command(model, free_port(), connector=connector, kv_bytes=256 << 20, max_model_len=8192,
                         served_name="outage", dtype=spec.dtype)
    hooks_dir = root / "hooks"
    hooks_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"prompt_words": prompt_words, "decode_tokens": decode_tokens, "arrivals": arrivals,
                           "dtype": spec.dtype, "phases": {}}
    daemon.start()

    def restart() -> None:
        daemon.start()

    try:
        with VllmServer(cmd, root / "vllm.log", env={"KVBM_HOOK_TIMES_DIR": str(hooks_dir)}) as server:
            cli = client(server)
            await stream_completion(cli, server.model, prompt(), 4)  # warm-up
            cold = [await stream_completion(cli, server.model, prompt(), 4) for _ in range(arrivals)]
            out["cold_ttft_s"] = [c.ttft_s for c in cold]

            async def phase(fault: str, prefill: bool) -> dict[str, Any]:
                """A decoding stream; 1 s after its first token the daemon is SIGKILLed (``kill``), SIGSTOPped
                (``stop``: alive and silent, its saves in flight) or left alone (``none``); with ``prefill``, new
                requests arrive at once then one after another, else the stream decodes alone for 4 s."""
                started = asyncio.Event()
                times: list[float] = []
                decode = asyncio.ensure_future(stream_decode(cli, server.model, prompt(200), decode_tokens, started,
                                                             times))
                await started.wait()
                await asyncio.sleep(1.0)
                before = hook_files(hooks_dir)
                t0 = time.time()
                if fault == "kill":
                    daemon.proc.kill()  # SIGKILL
                    daemon.proc.wait(10)
                elif fault == "stop":
                    daemon.proc.send_signal(signal.SIGSTOP)
                during: list[Completion] = []
                late: list[Completion] = []
                try:
                    if prefill:
                        during = list(await asyncio.gather(*(stream_completion(cli, server.model, prompt(), 4)
                                                             for _ in range(arrivals))))
                        late = [await stream_completion(cli, server.model, prompt(), 4) for _ in range(arrivals)]
                    else:
                        await asyncio.sleep(4.0)
                    t_end = time.time()
                finally:
                    if fault == "stop":
                        daemon.proc.send_signal(signal.SIGCONT)
                await asyncio.sleep(1.5)  # the hook-time files are written at most once a second
                decode.cancel()  # the decode spans the whole phase; the client hanging up aborts it in vLLM
                with contextlib.suppress(asyncio.CancelledError):
                    await decode
                if fault == "kill":
                    restart()
                done = bool(times) and decode_tokens <= len(times)
                return {
                    "decode_max_gap_before_s": max(gaps(times, 0, t0), default=None),
                    "decode_median_gap_before_s": statistics.median(gaps(times, 0, t0) or [0.0]),
                    "decode_max_gap_during_s": max(gaps(times, t0, t_end), default=None),
                    "decode_tokens_during": sum(t0 <= t < t_end for t in times),
                    "decode_finished_early": done,  # True: it ended inside the phase (raise --decode-tokens)
                    "new_concurrent_ttft_s": [c.ttft_s for c in during],
                    "new_after_ttft_s": [c.ttft_s for c in late],
                    "seconds": t_end - t0,
                    "errors": [c.error for c in [*during, *late] if c.error],
                    "hook_times": hook_delta(before, hook_files(hooks_dir)),
                }

            # Each fault alone (the stream decoding by itself) and with new prompts prefilled meanwhile.
            for fault in ("none", "stop", "kill"):
                for prefill in (False, True):
                    out["phases"][f"{fault}{'+prefill' if prefill else ''}"] = await phase(fault, prefill)
            out["healthy"], out["outage"] = out["phases"]["none+prefill"], out["phases"]["kill+prefill"]

            # The daemon is back: a prompt stored now hits after vLLM's own cache is reset.
            t_back = time.time()
            again = prompt()
            deadline = time.monotonic() + 60
            hit: Completion | None = None
            while time.monotonic() < deadline:
                await stream_completion(cli, server.model, again, 4)
                await asyncio.sleep(0.5)  # async saves land
                server.reset_prefix_cache()
                hit = await stream_completion(cli, server.model, again, 4)
                if hit.cached_tokens:
                    break
                again = prompt()
            out["after_restart"] = {"cached_tokens": hit.cached_tokens if hit else None,
                                    "hit_ttft_s": hit.ttft_s if hit else None,
                                    "seconds_after_restart": time.time() - t_back}
            out["hook_times_total"] = hook_files(hooks_dir)
    finally:
        daemon.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-words", type=int, default=3000)
    ap.add_argument("--decode-tokens", type=int, default=6000, help="at most (it is cut off after the phase)")
    ap.add_argument("--arrivals", type=int, default=2, help="new requests sent at once during the outage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON result file (else stdout)")
    ap.add_argument("--root", type=Path, help="keep the model, logs and daemon files here (else a temporary dir)")
    a = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        root = a.root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbm-outage-")))
        res = asyncio.run(run(root, a.prompt_words, a.decode_tokens, a.arrivals, a.seed))
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
