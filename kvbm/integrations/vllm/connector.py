"""KvbmConnector: vLLM's KV-connector class; it builds the scheduler or worker side by role and delegates."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbm.blocks.layout import KVLayout
from kvbm.integrations.vllm.compat import check_vllm
from kvbm.integrations.vllm.config import ConnectorConfig, curve_options
from kvbm.integrations.vllm.epoch import WeightsEpoch
from kvbm.integrations.vllm.fingerprint import layout_for, storing_ranks
from kvbm.integrations.vllm.geometry import Geometry
from kvbm.integrations.vllm.groups import kv_groups
from kvbm.integrations.vllm.hooks import KvbmConnectorStats
from kvbm.integrations.vllm.link import Links
from kvbm.integrations.vllm.metadata import KvbmWorkerMetadata
from kvbm.integrations.vllm.scheduler import SchedulerSide
from kvbm.integrations.vllm.worker import WorkerSide

logger = logging.getLogger("kvbm.vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class KvbmConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by the kvbm daemon: a scheduler side or a worker side, by role.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``) for the KV-cache group kinds
    :mod:`kvbm.integrations.vllm.groups` handles; any other kind is an error at startup."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        check_vllm()  # an unsupported vLLM fails here, naming the supported range
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = cfg = ConnectorConfig.parse(ktc.kv_connector_extra_config)
        if cfg.async_load is None:
            # On a CPU engine vLLM's steps keep every core busy, so a request waiting on the loader thread
            # waits long (measured: a G4 hit 5x slower than loading in the step at TP=1; stalls at TP=2).
            # From the config both sides share, so the scheduler and every rank agree.
            cfg.async_load = str(vllm_config.device_config.device_type) != "cpu"
        if cfg.load_failure_policy == "recompute":
            # kvbm is a cache: a block that cannot be loaded is recomputed, never an error.
            ktc.kv_load_failure_policy = "recompute"
        model_name = str(cfg.model_name or vllm_config.model_config.served_model_name or vllm_config.model_config.model)
        bs = vllm_config.cache_config.block_size
        groups = kv_groups(self._kv_cache_config, bs)  # at startup: a group kvbm cannot store is an error
        if groups.count > 1 and not cfg.async_load:
            # With several KV-cache groups vLLM takes a failed load only per request, and only from a request
            # waiting for its load (an async one): a sync load that came up short could not be reported.
            if ktc.kv_connector_extra_config and ktc.kv_connector_extra_config.get("async_load") is False:
                logger.warning("kvbm: %d KV-cache groups: loads are asynchronous (async_load: false is not "
                               "honoured; vLLM accepts a short load of such a model only from an async one)",
                               groups.count)
            cfg.async_load = True
        pc = vllm_config.parallel_config
        # Every worker of the engine: PP stage-major, then TP rank (vLLM's rank order).
        ranks = range(pc.pipeline_parallel_size * pc.tensor_parallel_size)
        # Layout arithmetic, identical on the scheduler and every rank, so all derive the same k; the
        # biggest stage's block (stages may hold unequal numbers of layers) must fit a daemon block.
        vblock = max(layout_for(vllm_config, r, bs, model_name).block_nbytes for r in ranks)
        geometry = Geometry(bs, vblock, cfg.vllm_blocks_per_kvbm_block)
        links = Links(cfg.endpoint(), geometry, str(ktc.engine_id or "vllm"), cfg.timeout_s,
                      lambda rank, k: layout_for(vllm_config, rank, k * bs, model_name), curve_options(cfg),
                      WeightsEpoch(cfg.weights_version))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(cfg, links, storing_ranks(vllm_config), groups)
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            rank = get_pp_group().rank_in_group * pc.tensor_parallel_size + get_tensor_model_parallel_rank()
            storing = storing_ranks(vllm_config)
            self._worker = WorkerSide(cfg, links, rank, getattr(self._kv_cache_config, "num_blocks", None),
                                      saves=rank in storing, groups=groups,
                                      pin_rank=max(r for r in storing if r <= rank))

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvbm: a scheduler-side hook was called on a worker-side connector")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvbm: a worker-side hook was called on the scheduler-side connector")
        return self._worker

    # Scheduler side (EngineCore process).
    def layouts(self) -> list[KVLayout]:
        """The layout (and so the namespace) of each worker; empty until the daemon was reached."""
        return self.scheduler.layouts()

    def on_new_request(self, request: Request) -> None:
        with self.scheduler.hooks.time("on_new_request"):
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        with self.scheduler.hooks.time("get_num_new_matched_tokens"):
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        with self.scheduler.hooks.time("update_state_after_alloc"):
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self.scheduler.hooks.time("build_connector_meta"):
            meta = self.scheduler.build_connector_meta(scheduler_output)
        self.scheduler.hooks.end_step()  # the scheduler's last hook of a step
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        with self.scheduler.hooks.time("update_connector_output"):
            self.scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``, a weight update): a new weights
        epoch, so nothing stored before it is ever loaded again (:mod:`kvbm.integrations.vllm.epoch`)."""
        self.scheduler.reset_cache()
        return True

    def has_pending_push_work(self) -> bool:
        """Finished requests whose blocks kvbm still holds for a save or load: the engine keeps stepping until
        the worker reports them (else an idle engine never frees them, and a cache reset fails)."""
        return self._scheduler is not None and self._scheduler.holds_blocks()

    def has_pending_block_frees(self) -> bool:
        """Blocks held only for saves that are about to end: vLLM waits a step rather than preempting."""
        return self._scheduler is not None and self._scheduler.frees_soon()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self.scheduler.hooks.time("request_finished"):
            return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook under its hybrid KV cache manager (every group's blocks): the same bookkeeping."""
        with self.scheduler.hooks.time("request_finished"):
            return self.scheduler.request_finished(request, list(block_ids[0]) if block_ids else [])

    # Worker side (one per TP rank); the metadata is the one vLLM bound for this step.
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> KvbmWorkerMetadata | None:
        return self.worker.worker_meta()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM reads after each step: saves and loads over, and loads that failed (per request: the only
        form vLLM takes for a model with several KV-cache groups)."""
        sending, recving, failed = self.worker.get_finished(finished_req_ids)
        self.worker.hooks.end_step()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def get_kv_connector_stats(self) -> KvbmConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.hooks.take_interval()
        return KvbmConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvbmConnectorStats | None:
        return KvbmConnectorStats(data=data or {})

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.hooks.dump()
                side.shutdown()
