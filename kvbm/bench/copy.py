"""``kvbm bench copy``: the connector's copy between G2 slot bytes and vLLM's paged KV, against a memcpy.

A vLLM-shaped paged KV cache (the CPU backend's per-layer ``[num_blocks, kv_heads, block_size, 2 * head_size]``
tensors) and N kvbm blocks of ``k`` vLLM blocks each in one slot buffer; :class:`PagedCache` copies every block
in (a load) and out (a save), timed against ``torch.Tensor.copy_`` of one contiguous tensor of the same bytes (on
torch's intra-op threads) and ``numpy.copyto`` of them (one thread: a plain memcpy, as the copy by address is).
Block ids come in ``runs`` (vLLM's allocation of a fresh request: consecutive ids) or ``scattered`` (a shuffled
pool: every vLLM block a copy of its own). Medians of ``repeats``, each timing the memcpy, the load and the save
in turn (ratios per repeat); the save must read back exactly what the load wrote.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from kvbm.bench.common import load_avg, machine
from kvbm.integrations.vllm.paged import PagedCache
from kvbm.integrations.vllm.stages import Stages

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ORDERS = ("runs", "scattered")


@dataclass
class CopyBenchOptions:
    layers: int = 8
    kv_heads: int = 4
    head_size: int = 64
    block_size: int = 128  # tokens per vLLM block
    k: int = 2  # vLLM blocks per kvbm block
    blocks: int = 16  # kvbm blocks copied per repeat
    dtype: str = "float32"
    repeats: int = 7
    threads: int = 0  # torch intra-op threads (0: torch's default)
    seed: int = 0

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        for name in ("layers", "kv_heads", "head_size", "block_size", "k", "blocks", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def vblock_bytes(self) -> int:
        return self.layers * self.kv_heads * self.block_size * 2 * self.head_size * DTYPES[self.dtype].itemsize

    @property
    def block_bytes(self) -> int:
        return self.k * self.vblock_bytes


def _ids(o: CopyBenchOptions, order: str) -> list[list[int]]:
    """Per kvbm block its ``k`` vLLM block ids (block 0 is vLLM's null block, never handed out)."""
    pool = list(range(1, o.blocks * o.k + 1))
    if order == "scattered":
        random.Random(o.seed).shuffle(pool)
    return [pool[i * o.k : (i + 1) * o.k] for i in range(o.blocks)]


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _interleaved(fns: dict[str, Any], nbytes: int, repeats: int) -> dict[str, list[float]]:
    """GB/s of each of ``fns`` per repeat, run one after another within each repeat (a shared machine's load
    then weighs on all of them alike; the ratios are taken per repeat)."""
    for fn in fns.values():
        fn()  # warm: page faults and torch's first-call costs out of the timing
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(round(nbytes / _timed(fn) / 1e9, 3))
    return out


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def run_copy(o: CopyBenchOptions) -> dict[str, Any]:
    o.check()
    if o.threads:
        torch.set_num_threads(o.threads)
    dt = DTYPES[o.dtype]
    nblocks = o.blocks * o.k + 1
    gen = torch.Generator().manual_seed(o.seed)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(nblocks, o.kv_heads, o.block_size, 2 * o.head_size,
                                                               dtype=dt) for i in range(o.layers)}
    stages = Stages()
    cache = PagedCache(caches, nblocks, stages=stages)
    assert cache.vblock_bytes == o.vblock_bytes, (cache.vblock_bytes, o.vblock_bytes)
    total = o.blocks * o.block_bytes
    slots = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
    back = torch.empty_like(slots)
    views = [slots[i * o.block_bytes : (i + 1) * o.block_bytes] for i in range(o.blocks)]
    backs = [back[i * o.block_bytes : (i + 1) * o.block_bytes] for i in range(o.blocks)]
    dst = torch.empty_like(slots)
    src_np, dst_np = slots.numpy(), dst.numpy()
    report: dict[str, Any] = {
        "bench": "copy", "machine": machine(), "options": asdict(o), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "load_avg_start": load_avg(),
        "vblock_bytes": o.vblock_bytes, "block_bytes": o.block_bytes, "bytes_per_repeat": total, "orders": {}}
    for order in ORDERS:
        ids = _ids(o, order)

        def load(ids: list[list[int]] = ids) -> None:
            for v, b in zip(views, ids, strict=True):
                cache.copy(v, b, True)

        def save(ids: list[list[int]] = ids) -> None:
            for v, b in zip(backs, ids, strict=True):
                cache.copy(v, b, False)

        before = stages.snapshot()
        g = _interleaved({"memcpy": lambda: dst.copy_(slots), "memcpy1": lambda: np.copyto(dst_np, src_np),
                          "load": load, "save": save}, total, o.repeats)
        counted = stages.snapshot()
        exact = bool(torch.equal(back, slots))  # the save read back exactly what the load wrote
        runs = (o.repeats + 1) * o.blocks
        report["orders"][order] = {
            "memcpy_gbps": _med(g["memcpy"]), "load_gbps": _med(g["load"]), "save_gbps": _med(g["save"]),
            "load_over_memcpy": _med([x / m for x, m in zip(g["load"], g["memcpy"], strict=True)]),
            "save_over_memcpy": _med([x / m for x, m in zip(g["save"], g["memcpy"], strict=True)]),
            "memcpy1_gbps": _med(g["memcpy1"]),
            "load_over_memcpy1": _med([x / m for x, m in zip(g["load"], g["memcpy1"], strict=True)]),
            "save_over_memcpy1": _med([x / m for x, m in zip(g["save"], g["memcpy1"], strict=True)]),
            "byte_exact": exact, "gbps_per_repeat": g,
            # what the connector's stage counters saw of the loads: every byte of every block
            "stage_copy_in_bytes": counted.get("copy_in_bytes", 0) - before.get("copy_in_bytes", 0),
            "expected_copy_in_bytes": runs * o.block_bytes}
        back.zero_()
    report["load_avg_end"] = load_avg()
    r, r1 = report["orders"]["runs"]["load_over_memcpy"], report["orders"]["runs"]["load_over_memcpy1"]
    report["goals"] = {"load_runs_over_memcpy": r, "load_at_least_80pct_of_memcpy": r >= 0.8,
                       "load_runs_over_memcpy1": r1, "load_at_least_80pct_of_memcpy1": r1 >= 0.8}
    return report


def copy_table(report: dict[str, Any], markdown: bool = False) -> str:
    from kvbm.bench.report import table

    rows = [[order, r["load_gbps"], r["save_gbps"], r["memcpy_gbps"], r["load_over_memcpy"], r["save_over_memcpy"],
             r["memcpy1_gbps"], r["load_over_memcpy1"], "yes" if r["byte_exact"] else "NO"]
            for order, r in report["orders"].items()]
    o = report["options"]
    head = (f"{o['blocks']} kvbm blocks x {report['block_bytes'] / 2**20:.2f} MiB ({o['k']} vLLM blocks of "
            f"{o['block_size']} tokens, {o['layers']} layers, {o['dtype']}), median of {o['repeats']}")
    return head + "\n" + table(("block ids", "load GB/s", "save GB/s", "memcpy GB/s", "load/memcpy",
                                "save/memcpy", "1-thread memcpy GB/s", "load/1-thread", "byte-exact"), rows, markdown)
