"""``kvbm bench long-doc-qa``: time to first token, recompute vs kvbm cache hits from G2, G3 and G4.

A tiny decoder-only transformer (random weights, float32, CPU) stands in for the model: its prefill returns
per-layer K/V, which are packed into kvbm blocks per a :class:`~kvbm.blocks.layout.KVLayout` (one block =
``[layer][K|V][head][token][head_dim]`` for ``tokens_per_block`` tokens) and keyed by kvbm's chained prefix
hashes. The warm-up pass prefills each document and stores its full blocks (write-through to G3 and G4,
durable). The query pass sends ``document + question`` requests (``tile``: d0 d1 .. dn d0 d1 ..; ``random``:
shuffled) with ``inflight`` requests at once, and measures TTFT per source:

* ``recompute``: prefill of the whole request;
* ``G2`` / ``G3`` / ``G4``: ``manager.lookup`` + ``manager.onboard`` (to G2) + unpacking the blocks from G2 into
  the model's K/V tensors + prefill of the uncached suffix (the question and any partial block). The source
  tier is forced by deleting the document's blocks from the tiers above it (and, for G3, dropping their
  page cache) before the request's clock starts.

The first-token logits of every hit are checked against the recompute of the same request.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kvbm.bench.common import BenchTarget, summary
from kvbm.bench.runner import BenchRun
from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import prefix_hashes
from kvbm.blocks.layout import KVLayout
from kvbm.config import Config

MiB = 1024 * 1024


@dataclass
class LongDocOptions(BenchTarget):
    doc_lengths: tuple[int, ...] = (1024, 4096, 8192)
    docs: int = 2
    queries: int = 2  # queries per document (per source)
    query_tokens: int = 32
    order: str = "tile"  # tile | random
    inflight: int = 1
    sources: tuple[str, ...] = ("recompute", "G2", "G3", "G4")
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 32000
    tokens_per_block: int = 256
    s3_client: str = "aiobotocore"
    seed: int = 0


# -- the model ---------------------------------------------------------------------------------------
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [heads, tokens, head_dim]


class TinyDecoder(nn.Module):
    """Pre-norm decoder: sinusoidal positions, multi-head causal attention, GELU MLP (no RoPE, no GQA)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seed: int = 0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
        torch.manual_seed(seed)
        self.layers, self.hidden, self.heads, self.head_dim = layers, hidden, heads, hidden // heads
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(hidden), "qkv": nn.Linear(hidden, 3 * hidden), "out": nn.Linear(hidden, hidden),
                "ln2": nn.LayerNorm(hidden), "up": nn.Linear(hidden, 4 * hidden), "down": nn.Linear(4 * hidden, hidden),
            }))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.eval()

    def _pos(self, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n, dtype=torch.float32)[:, None]
        i = torch.arange(0, self.hidden, 2, dtype=torch.float32)[None, :]
        ang = pos / torch.pow(10000.0, i / self.hidden)
        pe = torch.zeros(n, self.hidden)
        pe[:, 0::2] = torch.sin(ang)
        pe[:, 1::2] = torch.cos(ang)
        return pe

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Logits of the last position and the full K/V (past + new) of every layer."""
        past_len = past[0][0].shape[1] if past else 0
        n = tokens.shape[0]
        x = self.embed(tokens) + self._pos(past_len, n)
        mask = None
        if past_len:
            # new token i (at position past_len + i) sees every past token and new tokens <= i
            mask = torch.ones(n, past_len + n, dtype=torch.bool).tril(diagonal=past_len)
        kv: KV = []
        h, d = self.heads, self.head_dim
        for li, blk in enumerate(self.blocks):
            q, k, v = blk["qkv"](blk["ln1"](x)).view(n, 3, h, d).permute(1, 2, 0, 3)  # each [h, n, d]
            if past_len:
                k = torch.cat([past[li][0], k], dim=1)  # type: ignore[index]
                v = torch.cat([past[li][1], v], dim=1)  # type: ignore[index]
            kv.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            x = x + blk["out"](a.permute(1, 0, 2).reshape(n, self.hidden))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return self.head(self.ln_f(x[-1])), kv


def pack_block(kv: KV, b: int, bt: int) -> np.ndarray:
    """Block ``b`` (tokens ``b*bt .. (b+1)*bt``) as bytes laid out ``[layer][K|V][head][token][dim]``."""
    parts = [torch.stack([k[:, b * bt : (b + 1) * bt], v[:, b * bt : (b + 1) * bt]]) for k, v in kv]
    return torch.stack(parts).contiguous().view(torch.uint8).reshape(-1).numpy()


def unpack_blocks(views: list[torch.Tensor], layout: KVLayout) -> KV:
    """The inverse of :func:`pack_block` for consecutive blocks: per layer (K, V) [heads, n*bt, dim]."""
    L, h, d, bt = layout.num_layers, layout.kv_heads_per_rank, layout.head_size, layout.block_tokens
    blocks = [v.view(torch.float32).view(L, 2, h, bt, d) for v in views]
    full = torch.cat(blocks, dim=3)  # one copy out of the G2 slots: [L, 2, h, T, d]
    return [(full[i, 0], full[i, 1]) for i in range(L)]


# -- the bench ---------------------------------------------------------------------------------------
async def run_longdoc(opts: LongDocOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    from kvbm.stack import build_stack

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = TinyDecoder(opts.layers, opts.hidden, opts.heads, opts.vocab, opts.seed)
    layout = KVLayout(model=f"kvbm-bench/tiny-{opts.layers}x{opts.hidden}", num_layers=opts.layers,
                      num_kv_heads=opts.heads, head_size=opts.hidden // opts.heads, dtype="float32",
                      tokens_per_block=opts.tokens_per_block, block_bytes=1)
    bt, blk_bytes = layout.block_tokens, layout.block_nbytes
    rng = np.random.default_rng(opts.seed)
    rows: list[dict[str, Any]] = []
    need_s3 = "G4" in opts.sources
    bench = BenchRun(
        "long-doc-qa", opts, echo, s3=need_s3, rows=rows,
        model={"layers": opts.layers, "hidden": opts.hidden, "heads": opts.heads, "vocab": opts.vocab,
                  "params": sum(p.numel() for p in model.parameters()), "dtype": "float32",
               "torch_threads": torch.get_num_threads()},
        layout={"namespace": layout.namespace, "tokens_per_block": bt, "block_bytes": blk_bytes,
                "bytes_per_token": layout.bytes_per_token})
    report = bench.report
    max_blocks = max(opts.doc_lengths) // bt * opts.docs
    echo(f"kvbm bench long-doc-qa: tiny decoder {opts.layers}L/{opts.hidden}H/{opts.heads} heads "
         f"({report['model']['params'] / 1e6:.1f}M params), {bt} tokens = {blk_bytes / MiB:g} MiB per block, "
         f"{opts.docs} docs x {opts.queries} queries, order {opts.order}, inflight {opts.inflight}")
    with bench:
        work, srv = bench.work, bench.srv
        cap = (max_blocks + 2) * blk_bytes
        d: dict[str, Any] = {
            "block_bytes": blk_bytes, "device": {"enabled": False}, "host": {"capacity": cap, "pin": True},
            "disk": {"dir": str(work / "g3"), "capacity": 2 * cap + (64 << 20), "o_direct": True, "fsync": True},
            "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "auto"},
        }
        if srv is not None:
            d["s3"] = {"enabled": True, "endpoint": srv["endpoint"], "bucket": srv["bucket"], "prefix": srv["prefix"],
                       "access_key": srv["access_key"], "secret_key": srv["secret_key"], "client": opts.s3_client,
                       "max_pending_writes": max(64, max_blocks)}
        tiers = ("G2", "G3", "G4") if srv is not None else ("G2", "G3")
        stack = await build_stack(msgspec.convert(d, Config), tiers=tiers, index=False)
        mgr = stack.manager
        g2, g3 = mgr.by_name["G2"], mgr.by_name["G3"]
        report["paths"] = stack.describe().get("transfer")
        try:
            for doc_len in opts.doc_lengths:
                await _one_length(opts, doc_len, model, layout, mgr, g2, g3, rng, rows, echo)
        finally:
            await stack.close()
    return report


async def _one_length(opts: LongDocOptions, doc_len: int, model: TinyDecoder, layout: KVLayout, mgr: Any, g2: Any,
                      g3: Any, rng: np.random.Generator, rows: list[dict[str, Any]],
                      echo: Callable[[str], None]) -> None:
    bt = layout.block_tokens
    docs = [rng.integers(0, opts.vocab, size=doc_len) for _ in range(opts.docs)]
    salt = secrets.token_hex(4)  # fresh hashes per run: nothing left over from an earlier one can hit
    doc_keys = [[BlockKey(layout.namespace, h) for h in prefix_hashes(doc, bt, salt=salt)] for doc in docs]
    # Warm-up: prefill each document and store its full blocks; durable = on G3 and G4 too.
    t = time.perf_counter()
    for doc, keys in zip(docs, doc_keys, strict=True):
        _, kv = await asyncio.to_thread(model.prefill, torch.from_numpy(doc))
        for b, k in enumerate(keys):
            await mgr.put(k, memoryview(pack_block(kv, b, bt)), tier="G2", cascade=False)
        got = await mgr.offload(keys, durable=True)
        if got != len(keys):
            raise RuntimeError(f"only {got}/{len(keys)} blocks became durable")
    warm_s = time.perf_counter() - t
    # Requests: (doc index, question tokens); tile: d0..dn repeated; random: shuffled.
    reqs = [(i, rng.integers(0, opts.vocab, size=opts.query_tokens)) for _q in range(opts.queries)
            for i in range(opts.docs)]
    if opts.order == "random":
        random.Random(opts.seed).shuffle(reqs)
    echo(f"  {doc_len} tokens: {len(doc_keys[0])} blocks/doc, warm-up {warm_s:.1f}s")
    ref_logits: dict[int, torch.Tensor] = {}
    recompute_mean = None
    for source in opts.sources:
        if source not in ("recompute", *[t.name for t in mgr.tiers]):
            continue
        locks = [asyncio.Lock() for _ in docs]
        ttft: list[float] = []
        parts: dict[str, list[float]] = {"lookup": [], "onboard": [], "unpack": [], "prefill": []}
        max_diff = 0.0
        queue: asyncio.Queue[int] = asyncio.Queue()
        for j in range(len(reqs)):
            queue.put_nowait(j)

        async def worker(source: str = source, queue: asyncio.Queue[int] = queue, locks: list[asyncio.Lock] = locks,
                         ttft: list[float] = ttft, parts: dict[str, list[float]] = parts) -> None:
            nonlocal max_diff
            while not queue.empty():
                j = queue.get_nowait()
                di, q = reqs[j]
                tokens = np.concatenate([docs[di], q])
                async with locks[di]:
                    if source != "recompute":
                        await _force_source(mgr, g3, doc_keys[di], source)
                    t0 = time.perf_counter()
                    if source == "recompute":
                        logits, _ = await asyncio.to_thread(model.prefill, torch.from_numpy(tokens))
                        ttft.append(time.perf_counter() - t0)
                        ref_logits[j] = logits
                        continue
                    keys = [BlockKey(layout.namespace, h) for h in prefix_hashes(tokens, bt, salt=salt)]
                    found = mgr.lookup(keys)
                    t1 = time.perf_counter()
                    n = await mgr.onboard(keys[: len(found)], to="G2") if found else 0
                    t2 = time.perf_counter()
                    views = [g2.block_tensor(k) for k in keys[:n]]
                    if any(v is None for v in views):
                        raise RuntimeError("an onboarded block left G2 before it was read")
                    past = unpack_blocks(views, layout) if n else None  # type: ignore[arg-type]
                    t3 = time.perf_counter()
                    logits, _ = await asyncio.to_thread(model.prefill, torch.from_numpy(tokens[n * bt :]), past)
                    t4 = time.perf_counter()
                    ttft.append(t4 - t0)
                    parts["lookup"].append(t1 - t0)
                    parts["onboard"].append(t2 - t1)
                    parts["unpack"].append(t3 - t2)
                    parts["prefill"].append(t4 - t3)
                    if n != len(doc_keys[di]):
                        raise RuntimeError(f"{source}: {n}/{len(doc_keys[di])} document blocks hit")
                    if j in ref_logits:
                        max_diff = max(max_diff, float((logits - ref_logits[j]).abs().max()))

        await asyncio.gather(*(worker() for _ in range(max(1, opts.inflight))))
        s = summary([x * 1e3 for x in ttft])
        row: dict[str, Any] = {"doc_tokens": doc_len, "source": source, "ttft_ms": s,
                               "blocks_per_doc": len(doc_keys[0]),
                               "kv_bytes_per_doc": len(doc_keys[0]) * layout.block_nbytes}
        if source == "recompute":
            recompute_mean = s["mean"]
        else:
            row["breakdown_ms"] = {k: round(float(np.mean(v)) * 1e3, 3) for k, v in parts.items() if v}
            row["max_abs_logit_diff_vs_recompute"] = max_diff
        row["speedup"] = round(recompute_mean / s["mean"], 2) if recompute_mean and s["mean"] else None
        rows.append(row)
        bd = row.get("breakdown_ms")
        extra = (f"  (lookup {bd['lookup']:.2f} + onboard {bd['onboard']:.1f} + unpack {bd['unpack']:.1f} + "
                 f"prefill {bd['prefill']:.1f} ms; max logit diff {max_diff:.1e})") if bd else ""
        echo(f"    {source:<9} TTFT mean {s['mean']:8.1f} ms  p50 {s['p50']:8.1f}  p90 {s['p90']:8.1f}  "
             f"p99 {s['p99']:8.1f}{extra}")
    for keys in doc_keys:
        await mgr.delete(keys)


async def _force_source(mgr: Any, g3: Any, keys: list[BlockKey], source: str) -> None:
    """Leave the document's blocks only in ``source`` and the tiers below it (untimed)."""
    names = [t.name for t in mgr.tiers]
    above = names[: names.index(source)]
    if source != "G2" and any(not mgr.registry.holds(source, k) for k in keys):
        raise RuntimeError(f"{source} lost blocks of a document")
    if source == "G2":
        # The blocks must be in G2: bring them up from below if an earlier pass removed them (untimed).
        await mgr.onboard(keys, to="G2")
        return
    if above:
        await mgr.delete(keys, tiers=above)
    if source == "G3":
        await asyncio.to_thread(lambda: [g3.drop_page_cache(k) for k in keys])
