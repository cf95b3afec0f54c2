"""Conversations under preemption through vLLM's OpenAI server, and each one's next turn from kvbm.

A user's scenario, end to end: ``kvbm serve`` (G2 only), vLLM's OpenAI server with the connector and a KV cache
small enough that vLLM preempts, several conversations decoding at once (turn 1). Then vLLM's own prefix cache is
reset and each conversation's next turn (its prompt, its answer and a question, as token ids) is served: from
kvbm. Then the connector is reset too (``/reset_prefix_cache?reset_external=true``: a new weights epoch, so
nothing loads) and each next turn is computed. Each kvbm turn must answer what the computed one answers, token for
token: in float32 a wrong block shows in the tokens (noise ~1e-6); in bf16 a hit's last tokens round otherwise
than a full compute's, so a near tie may flip (``kvbm bench hit-numerics`` measures that rate for vLLM's own hit).
And every block the pressured epoch stored (turn 1 under preemption, the next turns from kvbm) is compared with the
block of the same tokens the computed epoch stored (one prefill each): the daemon writes both through to G3, whose
files (one namespace directory per epoch) are read back after the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.common import DaemonProc
from kvbm.bench.openai_server import VLLM_BLOCK, ModelSpec, VllmServer, client, free_port, server_command, write_model
from kvbm.blocks.format import decode_block
from kvbm.blocks.keys import parse_disk_relpath
from kvbm.verify.harness import describe_tokens

WORD = re.compile(r"w(\d+)")
BLOCK_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}  # batching/prefill-vs-decode noise; another block's KV is ~1


@dataclass
class ConversationOptions:
    conversations: int = 6
    prompt_tokens: int = 1500
    answer_tokens: int = 2500
    question_tokens: int = 20
    next_tokens: int = 16  # tokens generated for each next turn
    gpu_blocks: int = 110  # vLLM's KV cache in blocks (--num-gpu-blocks-override): small enough to preempt
    layers: int = 8
    dtype: str = "float32"
    seed: int = 0
    # The scenario checks what kvbm serves, not how long a loaded host's daemon may take to say it: a lookup waits
    # this long before the turn is computed (the request waits in vLLM's queue meanwhile, the engine does not).
    lookup_give_up_ms: float = 10_000.0


def _daemon(root: Path, block_bytes: str) -> DaemonProc:
    cfg = {"block_bytes": block_bytes, "device": {"enabled": False}, "host": {"capacity": "1GiB"},
           "disk": {"enabled": True, "dir": str(root / "g3"), "capacity": "4GiB"}, "s3": {"enabled": False},
           "embedded_s3": {"enabled": False},
           "daemon": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "metrics_port": -1}}
    return DaemonProc(root, cfg)


def _post(server: VllmServer, path: str) -> dict[str, Any]:
    req = urllib.request.Request(server.base_url + path, method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
    return json.loads(body) if body.strip() else {}


def _preemptions(server: VllmServer) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


async def _complete(cli: Any, model: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    out = await cli.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    details = getattr(out.usage, "prompt_tokens_details", None)
    return [int(w) for w in WORD.findall(out.choices[0].text)], int(getattr(details, "cached_tokens", 0) or 0)


def run(work: Path, o: ConversationOptions) -> dict[str, Any]:
    """The scenario; its report (``ok``: every kvbm turn hit kvbm and answered the computed one)."""
    rng = random.Random(o.seed)
    spec = ModelSpec(layers=o.layers, dtype=o.dtype, max_len=8192, seed=o.seed)
    model = write_model(work / "model", spec)
    per_vblock = spec.bytes_per_token * VLLM_BLOCK
    daemon = _daemon(work / "daemon", f"{per_vblock * 4}B")  # 4 vLLM blocks per kvbm block: partial blocks on
    max_len = o.prompt_tokens + o.answer_tokens + o.question_tokens + o.next_tokens + VLLM_BLOCK
    connector = {"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"daemon": daemon.endpoint, "model_name": "kvbm-conversations",
                                               "lookup_give_up_ms": o.lookup_give_up_ms}}
    cmd = server_command(model, free_port(), connector=connector, max_model_len=max_len, dtype=o.dtype,
                         kv_bytes=(o.gpu_blocks + 1) * per_vblock,
                         max_num_seqs=max(o.conversations, 2), served_name="conv",
                         extra=["--num-gpu-blocks-override", str(o.gpu_blocks)])
    prompts = [[rng.randint(3, 990) for _ in range(o.prompt_tokens)] for _ in range(o.conversations)]
    questions = [[rng.randint(3, 990) for _ in range(o.question_tokens)] for _ in range(o.conversations)]
    daemon.start()
    try:
        with VllmServer(cmd, work / "server.log") as server:
            report = asyncio.run(_turns(server, o, prompts, questions))
            # Read while the engine still runs: a turn's last blocks are saved at its next step (round 16's third
            # clean-clone run compared 2 of 3 blocks: the server stopped before the last turn's saves ran).
            stored = _g3_blocks(work / "daemon" / "g3")
        # The connector's link dropped and came back (ZeroMQ reported it lost on an overloaded host): the turns asked
        # meanwhile were computed, by design (a recompute, never a stall). Counted, so a miss has its reason.
        log = (work / "server.log").read_text(errors="replace")
        report["link_drops"] = log.count("unavailable, recomputing")
        report["kvbm_log"] = [line for line in log.splitlines() if line.startswith("kvbm:")][-20:]  # a miss's why
        report["blocks"] = compare_epochs(stored, o.dtype)
    finally:
        daemon.stop()
    report["ok"] = report["ok"] and report["blocks"]["compared"] > 0 and not report["blocks"]["differ"]
    report["options"] = asdict(o)
    return report


def _g3_blocks(top: Path, settle_s: float = 30.0) -> dict[str, dict[bytes, np.ndarray]]:
    """Every block file under ``top`` (once their count stopped growing: the write-through is asynchronous),
    by namespace and hash, its payload as float32 words."""
    seen, deadline = -1, time.monotonic() + settle_s
    while time.monotonic() < deadline:
        n = sum(len(f) for _, _, f in os.walk(top))
        if n == seen:
            break
        seen = n
        time.sleep(1.0)
    out: dict[str, dict[bytes, np.ndarray]] = {}
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(root).relative_to(top).parts
        for name in files:
            key = parse_disk_relpath((*rel, name))
            if key is None:
                continue
            payload = decode_block(key, Path(root, name).read_bytes())
            out.setdefault(key.namespace, {})[key.hash] = np.frombuffer(bytes(payload), np.uint8)
    return out


def _values(payload: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    return torch.frombuffer(bytearray(payload), dtype=getattr(torch, dtype)).double().numpy()


def compare_epochs(blocks: dict[str, dict[bytes, np.ndarray]], dtype: str) -> dict[str, Any]:
    """The blocks of the same tokens in the two epochs' namespaces: relative error per block, in the KV's dtype."""
    tolerance = BLOCK_TOLERANCE[dtype]
    spaces = sorted(blocks, key=lambda ns: len(blocks[ns]), reverse=True)
    if len(spaces) < 2:
        return {"namespaces": len(spaces), "compared": 0, "differ": [], "max_error": None}
    a, b = blocks[spaces[0]], blocks[spaces[1]]
    errors = {}
    for h in sorted(set(a) & set(b)):
        x, y = _values(a[h], dtype), _values(b[h], dtype)
        if x.shape != y.shape:
            errors[h] = float("inf")
            continue
        errors[h] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12))
    bad = [h.hex()[:16] for h, e in errors.items() if not e <= tolerance]
    return {"namespaces": len(spaces), "compared": len(errors), "differ": bad,
            "max_error": max(errors.values(), default=None), "tolerance": tolerance}


async def _turns(server: VllmServer, o: ConversationOptions, prompts: list[list[int]],
                 questions: list[list[int]]) -> dict[str, Any]:
    cli = client(server)
    answers = [a for a, _ in await asyncio.gather(*(_complete(cli, server.model, p, o.answer_tokens)
                                                     for p in prompts))]
    preempted = _preemptions(server)
    server.reset_prefix_cache()  # vLLM's own cache: a hit can only come from kvbm now
    nexts = [p + a + q for p, a, q in zip(prompts, answers, questions, strict=True)]
    from_kvbm = [await _complete(cli, server.model, t, o.next_tokens) for t in nexts]
    reset = _post(server, "/reset_prefix_cache?reset_external=true")  # a new weights epoch: nothing loads now
    computed = [await _complete(cli, server.model, t, o.next_tokens) for t in nexts]
    rows = []
    for i, ((got, cached), (want, cached_after)) in enumerate(zip(from_kvbm, computed, strict=True)):
        rows.append({"conversation": i, "answer_tokens": len(answers[i]), "next_turn_tokens": len(nexts[i]),
                     "cached_from_kvbm": cached, "cached_after_reset": cached_after, "same": got == want,
                     "detail": None if got == want else describe_tokens(got, want)})
    hits = sum(r["cached_from_kvbm"] > 0 for r in rows)
    same = sum(r["same"] for r in rows)
    return {"preemptions": preempted, "reset_external": reset, "next_turns": len(rows), "served_by_kvbm": hits,
            "same_as_computed": same, "cached_tokens_total": sum(r["cached_from_kvbm"] for r in rows),
            "ok": hits == len(rows) and same == len(rows), "rows": rows}
