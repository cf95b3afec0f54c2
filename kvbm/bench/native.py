"""vLLM's native offloading driven without a GPU: its real ``TieringOffloadingSpec`` and manager, a CPU primary
tier and real secondary tiers (kvbm's, vLLM's ``fs``), for ``kvbm bench native`` and the tests.

vLLM's engine refuses ``OffloadingConnector`` on a CPU platform, and its ``CPUOffloadingWorker`` copies only
between CUDA tensors and the primary tier; everything above that (the scheduler-side manager, the tiers, the
primary tier's shared memory) is plain Python. :class:`NativeEngine` plays the part of the scheduler and of
the GPU worker: it writes a chunk's bytes into the primary row the manager allotted (what the worker's DMA
does), completes the store (the manager cascades it to every secondary tier), and steps the scheduler
(``on_schedule_end``) until the tiers are done; a load is a lookup that promotes from a secondary tier
into the primary tier, then the row is read back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbm.integrations.vllm.native_config import TIER_MODULE, TIER_TYPE

KVBM_TIER = {"type": TIER_TYPE, "module_path": TIER_MODULE}


def offloading_config(tiers: list[dict[str, Any]], *, chunk_bytes: int = 8192, cpu_bytes: int = 1 << 20,
                      model: str = "kvbm-native-test", engine_id: str = "", events: bool = True,
                      tokens_per_block: int = 16) -> Any:
    """vLLM's normalized offloading config for one worker whose chunk (one vLLM block) is ``chunk_bytes``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("model.layers.0.attn", "model.layers.1.attn"), 0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [dict(t) for t in tiers]},
        engine_id=engine_id or f"kvbm-native-{uuid.uuid4().hex[:8]}", model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_block, 1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))


def chunk_keys(n: int, seed: str = "") -> list[bytes]:
    """``n`` OffloadKeys of group 0 (32-byte block hashes, as vLLM's sha256 makes them)."""
    import hashlib

    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256(f"{seed}/{i}".encode()).digest(), 0) for i in range(n)]


def chunk_bytes_of(key: bytes, n: int) -> np.ndarray:
    """The deterministic content of the chunk keyed ``key`` (``n`` bytes)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, n, dtype=np.uint8)


class NativeEngine:
    """One vLLM engine's scheduler-side offloading: ``TieringOffloadingSpec(config).get_manager()``."""

    def __init__(self, config: Any) -> None:
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.row_bytes = self.rows.shape[1]
        self._n = 0

    @property
    def tiers(self) -> list[Any]:
        return self.manager.secondary_tiers

    def _ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._n += 1
        ctx = ReqContext(f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, timeout_s: float = 60.0) -> float:
        """Step until no tier has work pending (every cascade reported); the seconds it took."""
        t0 = time.monotonic()
        while self.manager.has_pending_work():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"secondary tiers still busy after {timeout_s} s")
            self.step()
            time.sleep(0.001)
        return time.monotonic() - t0

    def store(self, keys: Sequence[bytes], fill: Any = chunk_bytes_of) -> int:
        """Store ``keys`` as a GPU worker would (primary rows written, store completed); cascades run in the
        background until :meth:`settle`. Returns the chunks the primary tier took."""
        ctx = self._ctx()
        out = self.manager.prepare_store(list(keys), ctx)
        if out is None:
            self.manager.on_request_finished(ctx)
            return 0
        for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[int(cid)] = fill(key, self.row_bytes)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        return len(out.keys_to_store)

    def lookup(self, keys: Sequence[bytes], timeout_s: float = 30.0) -> tuple[list[str], int, float]:
        """Look ``keys`` up the way vLLM's scheduler does (every key each step until none is pending), promoting
        secondary-tier hits into the primary tier. Returns each key's final result name, the steps it took and
        the seconds. The request stays open: :meth:`load` reads the rows, :meth:`finish` ends it."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self._ctx()
        self._open = ctx
        t0 = time.monotonic()
        steps = 0
        while True:
            res = [self.manager.lookup(k, ctx) for k in keys]
            if not any(r in (LookupResult.RETRY, LookupResult.HIT_PENDING) for r in res):
                return [r.name for r in res], steps, time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                return [r.name for r in res], steps, time.monotonic() - t0
            self.step()
            steps += 1
            time.sleep(0.0005)

    def read(self, keys: Sequence[bytes]) -> list[np.ndarray]:
        """The primary rows of ``keys`` (each a HIT in the primary tier), as the GPU worker would load them."""
        ctx = self._open
        spec = self.manager.prepare_load(list(keys), ctx)
        got = [self.rows[int(c)].copy() for c in spec.chunk_ids]
        self.manager.complete_load(list(keys), ctx)
        return got

    def finish(self) -> None:
        self.manager.on_request_finished(self._open)
        self.step()

    def reset_primary(self) -> None:
        """Empty the primary tier (vLLM's reset_cache: what reset_prefix_cache does to it)."""
        self.manager.reset_cache()

    def stats(self) -> dict[str, Any]:
        """The manager's metrics since the last call, reduced (``name:labels`` -> value)."""
        s = self.manager.get_stats()
        return s.reduce() if s is not None else {}

    def events(self) -> list[Any]:
        return list(self.manager.take_events())

    def shutdown(self) -> None:
        del self.rows
        self.manager.shutdown()
