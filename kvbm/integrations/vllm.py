"""KvbmConnector: kvbm embedded in vLLM (v1 KV-connector API) as an offload/onboard connector.

kvbm registers it with vLLM through the ``vllm.general_plugins`` entry point, so once kvbm is installed
next to vLLM it loads by name::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvbmConnector", "kv_role": "kv_both"}'

Optional ``kv_connector_extra_config`` keys: ``daemon`` (endpoint; else $KVBM_DAEMON, else
tcp://127.0.0.1:5557), ``model_name``, ``vllm_blocks_per_kvbm_block`` (by default derived from the
daemon: as many vLLM blocks as fill one of its ``block_bytes`` blocks), ``timeout_s``, ``save``, ``load``,
``async_load``, ``async_save``, ``load_failure_policy``; for a CURVE daemon ``curve_server_key`` (its
public key, Z85) or ``curve_server_key_file`` (its ``.key`` file) and ``curve_client_key_file`` (this
engine's ``.key_secret`` file from ``kvbm keys generate``, whose ``.key`` is in the daemon's allow-list).

* Scheduler side (EngineCore process): asks the daemon for the longest stored prefix of each new
  request, hands the worker side the vLLM block ids to fill (loads) and the full blocks to save, and
  reports the connector's health in ``kv_transfer_params`` when a request finishes.
* Worker side (one per TP rank): copies whole vLLM blocks of every layer between the paged KV cache and
  the daemon's G2 slots (shared memory); the daemon cascades them to disk and S3. Blocks are copied as
  the engine stores them (opaque bytes), never re-laid out per token: vLLM's CPU backend interleaves K
  and V inside a block in an ISA-specific order.
* A kvbm block spans ``k`` vLLM blocks and is keyed by vLLM's own hash of its last vLLM block, so kvbm
  and vLLM's KV events agree on identity (the namespace carries the layout fingerprint per TP rank).
  ``k`` is read from the daemon when the connector first reaches it (its G2 slot size, in ``Stats``,
  which needs no registration); a vLLM block bigger than the daemon's blocks is a configuration error,
  reported in ``kv_transfer_params`` and logged once at WARNING with both sizes and what to change.
* Every kvbm failure (daemon down, a checksum miss, S3 down) turns into a miss or a load error that vLLM
  recomputes (the connector switches ``kv_load_failure_policy`` to ``recompute`` unless the extra
  config asks for ``fail``); it is logged once and never raises into the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient
from kvbm.errors import ConfigError, KvbmError
from kvbm.layout import DTYPE_BYTES, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvbm.vllm")

RETRY_AFTER_S = 5.0
MAX_RETRY_AFTER_S = 60.0
K_SETTING = "vllm_blocks_per_kvbm_block"
_warned: set[str] = set()  # configuration errors already logged by this process (scheduler and workers)


class MisconfiguredError(KvbmError):
    """The engine's blocks and the daemon's do not fit together: a setting has to change."""


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


class _Geometry:
    """How many vLLM blocks make one kvbm block (``k``): as set in the extra config, else derived from the
    daemon's block size so that ``k`` vLLM blocks fill one daemon block. Fixed once first resolved (the
    namespace depends on it); every (re)connection checks it still fits the daemon's blocks."""

    def __init__(self, vllm_block_size: int, vblock_nbytes: int, k: int | None) -> None:
        self.vllm_block_size = vllm_block_size
        self.vblock_nbytes = vblock_nbytes  # one vLLM block of one TP rank, every layer
        self.explicit = k
        self.k: int | None = k

    def resolve(self, slot_bytes: int | None) -> int:
        if slot_bytes is None:  # a daemon that does not say: trust an explicit k, the daemon checks it
            if self.k is None:
                raise MisconfiguredError(f"kvbm: the daemon does not report its block size; set "
                                         f"kv_connector_extra_config.{K_SETTING}")
            return self.k
        k = self.k or slot_bytes // self.vblock_nbytes
        if k < 1 or k * self.vblock_nbytes > slot_bytes:
            raise MisconfiguredError(self.mismatch(slot_bytes))
        self.k = k
        return k

    def mismatch(self, slot_bytes: int) -> str:
        k = self.k or 1
        per_token = max(1, self.vblock_nbytes // self.vllm_block_size)
        fix = (f"set the daemon's block_bytes to at least {k * self.vblock_nbytes} B, or lower vLLM's "
               f"--block-size to at most {slot_bytes // per_token // k} tokens")
        if self.explicit:
            fix += f", or lower kv_connector_extra_config.{K_SETTING} (unset derives it)"
        return (f"kvbm: {k} vLLM block(s) of {self.vblock_nbytes} B ({self.vllm_block_size} tokens x {per_token} "
                f"B/token per TP rank) do not fit the daemon's block_bytes of {slot_bytes} B: {fix}. kvbm is "
                f"off for this engine until then (vLLM recomputes).")


def _daemon_block_bytes(client: WorkerClient) -> int | None:
    """The daemon's block size: its G2 slot size, from Stats (answered without registering)."""
    for tier in client.stats()["tiers"]:
        if tier.get("tier") == "G2" and tier.get("slot_bytes"):
            return int(tier["slot_bytes"])
    return None


@dataclass
class BlockTransfer:
    """kvbm blocks of one request and, for each, the ``k`` vLLM block ids it covers."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[list[int]]


@dataclass
class KvbmConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    k: int = 0  # the scheduler's vLLM blocks per kvbm block; workers refuse transfers planned with another


# vLLM cache_dtype -> the dtype of the bytes in its KV cache. "fp8" and "fp8_e4m3" are the platform's e4m3
# (float8_e4m3fn, or e4m3fnuz on some ROCm GPUs); "auto" is the model's dtype. Anything else (fp8_inc,
# fp8_ds_mla, per-token-head quantization, turboquant ...) packs scales or a custom layout into the block:
# refused rather than mislabelled.
_CACHE_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float": "float32",
                 "float32": "float32", "fp8_e5m2": "float8_e5m2"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def kv_cache_dtype(vllm_config: VllmConfig) -> str:
    """The kvbm dtype of vLLM's KV cache bytes; ConfigError for a cache dtype kvbm does not know."""
    cd = vllm_config.cache_config.cache_dtype or "auto"
    if cd == "auto":
        name = _dtype_name(vllm_config.model_config.dtype)
    elif cd in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        name = _dtype_name(current_platform.fp8_dtype())
    else:
        name = _CACHE_DTYPES.get(cd, "")
    if name not in DTYPE_BYTES:
        known = ", ".join(["auto", "fp8", "fp8_e4m3", *sorted(_CACHE_DTYPES)])
        raise ConfigError(f"kvbm cannot store vLLM's KV cache with cache_dtype {cd!r} ({name or 'a packed layout'}); "
                          f"use one of: {known}")
    return name


def kv_backend(vllm_config: VllmConfig) -> str:
    """What decides the byte order inside a vLLM block: platform, attention backend (as vLLM selects it),
    the CPU attention ISA (it interleaves K and V per ISA) and the vLLM block size."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    platform = "cpu" if not torch.cuda.is_available() else "cuda"
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(mc.get_head_size(), mc.dtype, cc.cache_dtype,
                                       use_mla=bool(getattr(mc, "use_mla", False))).get_name()
    except Exception as e:  # the engine itself fails to start in this case; name what was configured
        backend = str(getattr(vllm_config.attention_config.backend, "name", None) or "auto")
        log.warning("kvbm: cannot resolve vLLM's attention backend (%s); keying blocks by %r", e, backend)
    parts = ["vllm", platform, backend]
    if backend == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        try:
            parts.append(_get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype))
        except NotImplementedError as e:
            raise ConfigError(f"vLLM's CPU attention cannot run this KV cache: {e}") from None
    parts.append(f"bs{cc.block_size}")
    return "/".join(parts)


def layout_for(vllm_config: VllmConfig, tp_rank: int, block_tokens: int, model_name: str) -> KVLayout:
    """The kvbm layout of one TP rank's KV cache; its fingerprint keys everything that rank stores."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    revision = mc.revision or getattr(mc.hf_config, "_commit_hash", None) or ""
    return KVLayout(
        model=model_name,
        revision=str(revision),
        backend=kv_backend(vllm_config),
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=kv_cache_dtype(vllm_config),
        kv_factor=1 if getattr(mc, "use_mla", False) else 2,
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
        tokens_per_block=block_tokens,
        block_bytes=max(1, block_tokens) * 1,  # unused when tokens_per_block is set
    )


def curve_options(extra: dict[str, Any]) -> dict[str, Any]:
    """WorkerClient keyword arguments for the CURVE keys named in ``kv_connector_extra_config``."""
    from kvbm.security import load_keypair, load_public_key

    server = str(extra.get("curve_server_key") or "")
    if not server and extra.get("curve_server_key_file"):
        server = load_public_key(str(extra["curve_server_key_file"])).decode()
    key_file = extra.get("curve_client_key_file")
    if key_file and not server:
        raise ConfigError("kv_connector_extra_config.curve_client_key_file needs curve_server_key(_file) too")
    return {"curve_server_key": server, "curve_keypair": load_keypair(str(key_file)) if key_file else None}


class _Link:
    """A daemon client that degrades instead of failing: errors mark it down for a few seconds.

    On connecting it resolves the block geometry against the daemon, then registers ``layout_of(k)``."""

    def __init__(self, endpoint: str, geometry: _Geometry, layout_of: Callable[[int], KVLayout], engine_id: str,
                 worker_id: str, timeout_s: float, client_kw: dict[str, Any] | None = None):
        self.endpoint, self.engine_id, self.worker_id = endpoint, engine_id, worker_id
        self.client_kw = client_kw or {}
        self.geometry, self.layout_of = geometry, layout_of
        self.layout: KVLayout | None = None
        self.timeout_s = timeout_s
        self.client: WorkerClient | None = None
        self.down_until = 0.0
        self.degraded_reason = ""
        self.misconfigured = False
        self.warned = False
        self.failures = 0

    @property
    def degraded(self) -> bool:
        return bool(self.degraded_reason)

    def get(self) -> WorkerClient | None:
        if self.client is not None:
            return self.client
        if time.monotonic() < self.down_until:
            return None
        client = WorkerClient(self.endpoint, timeout_s=self.timeout_s, **self.client_kw)
        try:
            layout = self.layout_of(self.geometry.resolve(_daemon_block_bytes(client)))
            try:
                client.register(layout, worker_id=self.worker_id, engine_id=self.engine_id)
            except DaemonError as e:
                if e.code != p.E_BAD_REQUEST:
                    raise
                raise MisconfiguredError(f"kvbm: the daemon refused this engine's KV layout ({e.message}); "
                                         f"check the daemon's block_bytes and {K_SETTING}") from e
        except (MisconfiguredError, DaemonUnavailable, DaemonError, OSError) as e:
            client.close()
            self.fail(e)
            return None
        self.client, self.layout = client, layout
        if self.degraded_reason:
            log.warning("kvbm: daemon %s is back", self.endpoint)
        self.degraded_reason = ""
        self.misconfigured = False
        self.warned = False
        self.failures = 0
        return client

    def fail(self, e: BaseException) -> None:
        self.degraded_reason = f"{type(e).__name__}: {e}"
        # Back off (5 s, 10 s, ... 60 s) so a dead daemon costs the engine one timeout now and then.
        self.failures += 1
        self.down_until = time.monotonic() + min(MAX_RETRY_AFTER_S, RETRY_AFTER_S * 2 ** (self.failures - 1))
        self.misconfigured = isinstance(e, MisconfiguredError)
        if self.misconfigured:
            # Not an outage: retried (the daemon may be reconfigured), but said once and as it is.
            self.degraded_reason = str(e)
            _warn_once(str(e))
        elif not self.warned:
            log.warning("kvbm: daemon %s unavailable, recomputing instead (%s)", self.endpoint, e)
            self.warned = True
        if self.client is not None:
            self.client._reset()  # drop the socket so a late reply is never read as the next one
            self.client = None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


@dataclass
class _ReqState:
    hashes: list[bytes]  # one per kvbm block (vLLM hash of the last vLLM block in it)
    num_tokens: int
    local_tokens: int = 0  # vLLM's own prefix-cache hit when the request was admitted
    block_ids: list[int] = field(default_factory=list)
    load: BlockTransfer | None = None
    saved_blocks: int = 0  # kvbm blocks of this request already handed to the worker to save


class KvbmConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by the kvbm daemon."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.endpoint = str(extra.get("daemon") or os.environ.get("KVBM_DAEMON")
                            or os.environ.get("KVBM_DAEMON_ENDPOINT") or "tcp://127.0.0.1:5557")
        k = extra.get(K_SETTING)
        if k is not None and int(k) < 1:
            raise ValueError(f"kv_connector_extra_config.{K_SETTING} must be >= 1 (or unset: derived from the daemon)")
        self.vllm_block_size = vllm_config.cache_config.block_size
        self.model_name = str(extra.get("model_name") or vllm_config.model_config.served_model_name
                              or vllm_config.model_config.model)
        # Layout arithmetic, identical on the scheduler and every rank, so all derive the same k.
        vblock = layout_for(vllm_config, 0, self.vllm_block_size, self.model_name).block_nbytes
        self.geometry = _Geometry(self.vllm_block_size, vblock, None if k is None else int(k))
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.client_kw = curve_options(extra)
        self.save = bool(extra.get("save", True))
        self.load = bool(extra.get("load", True))
        self.async_load = bool(extra.get("async_load", True))
        self.async_save = bool(extra.get("async_save", True))
        self.engine_id = str(ktc.engine_id or "vllm")
        if str(extra.get("load_failure_policy", "recompute")) == "recompute":
            # kvbm is a cache: a block that cannot be loaded is recomputed, never an error.
            ktc.kv_load_failure_policy = "recompute"
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            # One scheduler serves all TP ranks: a prefix counts only if every rank stored it.
            self._links = [
                _Link(self.endpoint, self.geometry, self._layout_of(vllm_config, r), self.engine_id,
                      f"{self.engine_id}-scheduler-r{r}", self.timeout_s, self.client_kw)
                for r in range(self.tp_size)
            ]
            self._reqs: dict[str, _ReqState] = {}
            self._stats = {"lookups": 0, "hit_blocks": 0, "loads": 0, "saves": 0}
            # Requests whose blocks the worker may still be reading (async saves) or writing (async loads).
            # vLLM must not free those blocks at request_finished; the worker reports them as finished
            # sending / receiving instead. Both sides derive this from the same metadata, so they agree.
            self._save_pending: set[str] = set()
            self._load_pending: set[str] = set()
            self._connect()  # at startup: a configuration error shows now, not at the first request
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
            layout_of = self._layout_of(vllm_config, self.tp_rank)
            self._link = _Link(self.endpoint, self.geometry, layout_of, self.engine_id,
                               f"{self.engine_id}-worker-r{self.tp_rank}-{os.getpid()}", self.timeout_s, self.client_kw)
            self._kv: list[tuple[str, torch.Tensor, int]] = []  # (layer, cache, block dim)
            self._vblock_bytes = 0  # one vLLM block as the engine stores it, every layer
            self._load_errors: set[int] = set()
            # Async loads run on their own thread with their own daemon session (a client is single-threaded).
            self._load_link = _Link(self.endpoint, self.geometry, layout_of, self.engine_id,
                                    f"{self.engine_id}-loader-r{self.tp_rank}-{os.getpid()}", self.timeout_s,
                                    self.client_kw)
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvbm-load")
            self._loading: dict[str, Future[set[int]]] = {}
            # Async saves: copies into G2 run on their own thread (and CUDA stream) after each forward.
            self._save_link = _Link(self.endpoint, self.geometry, layout_of, self.engine_id,
                                    f"{self.engine_id}-saver-r{self.tp_rank}-{os.getpid()}", self.timeout_s,
                                    self.client_kw)
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvbm-save")
            self._saving: dict[str, list[Future[None]]] = {}
            self._finishing: set[str] = set()
            self._save_stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def _layout_of(self, vllm_config: VllmConfig, tp_rank: int) -> Callable[[int], KVLayout]:
        return lambda k: layout_for(vllm_config, tp_rank, k * self.vllm_block_size, self.model_name)

    @property
    def k(self) -> int:
        """vLLM blocks per kvbm block; 0 until resolved against a daemon."""
        return self.geometry.k or 0

    @property
    def block_tokens(self) -> int:
        return self.k * self.vllm_block_size

    # ------------------------------------------------------------------------------------------------
    # scheduler side
    # ------------------------------------------------------------------------------------------------
    def _connect(self) -> bool:
        """Register every rank's link now if it is not (each stops at its first failure)."""
        return all(link.get() is not None for link in self._links)

    def layouts(self) -> list[KVLayout]:
        """The layout (and so the namespace) of each TP rank; scheduler side, empty until the daemon was reached."""
        return [link.layout for link in self._links if link.layout is not None]

    def _kvbm_hashes(self, request: Request) -> list[bytes]:
        if not self.k and not self._connect():
            return []  # geometry unknown (daemon never reached): no loads, no saves for this request
        return [bytes(h) for h in request.block_hashes[self.k - 1 :: self.k]]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hashes = self._kvbm_hashes(request)
        self._reqs[request.request_id] = _ReqState(hashes=hashes, num_tokens=request.num_tokens,
                                                   local_tokens=num_computed_tokens)
        if not self.load or not hashes or num_computed_tokens % self.block_tokens:
            return 0, False
        # Leave at least one token to compute: vLLM needs logits for the last prompt token.
        max_blocks = (request.num_tokens - 1) // self.block_tokens
        matched = self._lookup(hashes[:max_blocks])
        self._stats["lookups"] += 1
        self._stats["hit_blocks"] += matched
        ext = matched * self.block_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, self.async_load

    def _lookup(self, hashes: list[bytes]) -> int:
        matched = len(hashes)
        for link in self._links:
            client = link.get()
            if client is None:
                return 0
            try:
                matched = min(matched, client.lookup([BlockKey(client.namespace, h) for h in hashes]).matched)
            except (DaemonUnavailable, DaemonError, OSError) as e:
                link.fail(e)
                return 0
        return matched

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        # External tokens follow the local prefix-cache hit (request.num_computed_tokens is still 0 here).
        local_blocks = st.local_tokens // self.block_tokens
        n = num_external_tokens // self.block_tokens
        idx = range(local_blocks, local_blocks + n)
        st.load = BlockTransfer(
            request.request_id, [st.hashes[i] for i in idx],
            [st.block_ids[i * self.k : (i + 1) * self.k] for i in idx],
        )
        st.saved_blocks = local_blocks + n  # loaded blocks are already stored

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvbmConnectorMetadata(k=self.k)
        for st in self._reqs.values():
            if st.load is not None:
                meta.loads.append(st.load)
                if self.async_load:
                    self._load_pending.add(st.load.req_id)
                self._stats["loads"] += len(st.load.hashes)
                st.load = None
        if self.save:
            for new in scheduler_output.scheduled_new_reqs:
                self._plan_save(meta, new.req_id, new.num_computed_tokens,
                                scheduler_output.num_scheduled_tokens.get(new.req_id, 0), None)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                new_ids = cached.new_block_ids[i] if cached.new_block_ids else None
                self._plan_save(meta, req_id, cached.num_computed_tokens[i],
                                scheduler_output.num_scheduled_tokens.get(req_id, 0), new_ids)
        return meta

    def _plan_save(self, meta: KvbmConnectorMetadata, req_id: str, computed: int, scheduled: int,
                   new_block_ids: Any) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        if new_block_ids:
            st.block_ids.extend(new_block_ids[0])
        if not st.hashes:
            return
        # Blocks whose every token is computed by the end of this step, prompt and output alike.
        done = min(len(st.hashes), (computed + scheduled) // self.block_tokens, len(st.block_ids) // self.k)
        if done > st.saved_blocks:
            idx = range(st.saved_blocks, done)
            meta.saves.append(BlockTransfer(req_id, [st.hashes[i] for i in idx],
                                            [st.block_ids[i * self.k : (i + 1) * self.k] for i in idx]))
            self._stats["saves"] += len(idx)
            st.saved_blocks = done
            if self.async_save:
                self._save_pending.add(req_id)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._load_pending.discard(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        # Blocks the worker may still be copying stay allocated until it reports the request: as finished
        # sending (async saves) or finished receiving (an async load of a request aborted while waiting).
        delay_free = rid in self._save_pending or rid in self._load_pending
        self._save_pending.discard(rid)
        degraded = [link for link in self._links if link.degraded]
        params: dict[str, Any] = {"kvbm": {
            "degraded": bool(degraded), "misconfigured": any(link.misconfigured for link in degraded),
            "endpoint": self.endpoint, K_SETTING: self.k, **self._stats}}
        if degraded:
            params["kvbm"]["reason"] = degraded[0].degraded_reason
        return delay_free, params

    # ------------------------------------------------------------------------------------------------
    # worker side
    # ------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._kv = []
        per_block = 0
        for name in sorted(kv_caches):
            t = kv_caches[name]
            # The block dimension: [num_blocks, ...] on CPU, [2, num_blocks, ...] for flash layouts.
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks] if num_blocks else [0]
            bdim = dims[0] if dims else 0
            self._kv.append((name, t, bdim))
            per_block += t.select(bdim, 0).numel() * t.element_size()
        self._vblock_bytes = per_block
        if per_block != self.geometry.vblock_nbytes:
            log.info("kvbm: engine block is %d B, layout arithmetic says %d B; storing the engine's bytes",
                     per_block, self.geometry.vblock_nbytes)
        client = self._link.get()  # at startup: a configuration error shows now, not at the first request
        if client is not None and client.registered is not None and self._block_bytes > client.registered.slot_bytes:
            # k came from the layout arithmetic; the engine's real blocks are bigger and overflow a slot.
            _warn_once(f"kvbm: this engine stores {per_block} B per vLLM block (the layout arithmetic says "
                       f"{self.geometry.vblock_nbytes} B), so {self.k} of them exceed the daemon's block_bytes of "
                       f"{client.registered.slot_bytes} B: set kv_connector_extra_config.{K_SETTING} to at most "
                       f"{client.registered.slot_bytes // per_block} or raise the daemon's block_bytes")

    @property
    def _block_bytes(self) -> int:
        return self._vblock_bytes * self.k

    def _same_k(self, meta: KvbmConnectorMetadata) -> bool:
        """Transfers planned with another k (a daemon restarted with other blocks in between) are refused."""
        if not self.k:
            self._link.get()  # this rank has not reached the daemon yet: resolve k now
        if meta.k == self.k:
            return True
        if not self.k:
            return False  # daemon unreachable from this rank: loads are recomputed, saves dropped
        _warn_once(f"kvbm: the scheduler plans {meta.k} vLLM blocks per kvbm block, this worker {self.k}; "
                   f"transfers skipped (vLLM recomputes); restart the engine")
        return False

    def _copy_blocks(self, slot_view: torch.Tensor, vblocks: list[int], to_engine: bool,
                     non_blocking: bool = False) -> None:
        off = 0
        for _name, cache, bdim in self._kv:
            for b in vblocks:
                blk = cache.select(bdim, b)
                n = blk.numel() * blk.element_size()
                host = slot_view[off : off + n].view(blk.dtype).view(blk.shape)
                if to_engine:
                    blk.copy_(host, non_blocking=non_blocking)
                else:
                    host.copy_(blk, non_blocking=non_blocking)
                off += n

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvbmConnectorMetadata) or not meta.loads:
            return
        if not self._same_k(meta):
            self._load_errors.update(i for tr in meta.loads for ids in tr.block_ids for i in ids)
            return
        for tr in meta.loads:
            if self.async_load:
                # The request waits (WAITING_FOR_REMOTE_KVS) while other requests keep stepping.
                self._loading[tr.req_id] = self._loader.submit(self._load_one, tr, self._load_link)
            else:
                self._load_errors.update(self._load_one(tr, self._link))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        if self._saving:
            # Requests vLLM finished (and, by the scheduler's rule, did not free) that had saves.
            self._finishing.update(r for r in finished_req_ids if r in self._saving)
            for rid in list(self._finishing):
                if all(f.done() for f in self._saving[rid]):
                    self._finishing.discard(rid)
                    del self._saving[rid]
                    sending.add(rid)
        done = {rid for rid, fut in self._loading.items() if fut.done()}
        for rid in done:
            # Reported in this same pass: vLLM reads load errors right after get_finished.
            self._load_errors.update(self._loading.pop(rid).result())
        return sending or None, done or None

    def _load_one(self, tr: BlockTransfer, link: _Link) -> set[int]:
        """Copy the request's kvbm blocks into its vLLM blocks; returns the vLLM block ids that failed."""
        loaded = 0
        try:
            loaded = self._onboard(tr, link)
        except Exception as e:  # a loader thread must never take the engine down
            log.warning("kvbm: load for request %s failed: %s", tr.req_id, e)
        failed: set[int] = set()
        if loaded < len(tr.hashes):
            # vLLM recomputes from the first block that did not arrive.
            for ids in tr.block_ids[loaded:]:
                failed.update(ids)
            log.info("kvbm: request %s loaded %d/%d blocks; the rest is recomputed", tr.req_id, loaded,
                     len(tr.hashes))
        return failed

    def _onboard(self, tr: BlockTransfer, link: _Link) -> int:
        loaded = 0
        client = link.get()
        if client is not None:
            ns = client.namespace
            try:
                rep = client.request(p.Onboard(namespace=ns, hashes=tr.hashes), p.Onboarded)
                try:
                    g2 = client.g2
                    assert g2 is not None
                    for i in range(rep.count):
                        if rep.nbytes[i] != self._block_bytes:
                            break
                        self._copy_blocks(g2.slot_tensor(rep.slots[i], rep.nbytes[i]), tr.block_ids[i], True)
                        loaded += 1
                finally:
                    if rep.count:
                        client.request(p.Release(namespace=ns, hashes=tr.hashes[: rep.count]), p.Released)
            except (DaemonUnavailable, DaemonError, OSError) as e:
                link.fail(e)
        return loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvbmConnectorMetadata) or not meta.saves or not self._same_k(meta):
            return
        if self.async_save:
            # The saver copies after everything queued so far (this step's forward) has run.
            ready = None
            if self._save_stream is not None:
                ready = torch.cuda.Event()
                ready.record()
            for tr in meta.saves:
                self._saving.setdefault(tr.req_id, []).append(self._saver.submit(self._save_async, tr, ready))
            return
        client = self._link.get()
        if client is None:
            return
        for tr in meta.saves:
            try:
                self._save_one(client, tr)
            except (DaemonUnavailable, DaemonError, OSError) as e:
                self._link.fail(e)
                return

    def _save_async(self, tr: BlockTransfer, ready: Any) -> None:
        client = self._save_link.get()
        if client is None:
            return
        try:
            if self._save_stream is not None:
                with torch.cuda.stream(self._save_stream):
                    self._save_stream.wait_event(ready)
                    self._save_one(client, tr, self._save_stream)
            else:
                self._save_one(client, tr)
        except (DaemonUnavailable, DaemonError, OSError) as e:
            self._save_link.fail(e)
        except Exception as e:  # a saver thread must never take the engine down
            log.warning("kvbm: save for request %s failed: %s", tr.req_id, e)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Preempted requests' blocks are about to be reused: finish every copy out of them first.
        for futs in list(self._saving.values()):
            for f in futs:
                f.result()

    def _save_one(self, client: WorkerClient, tr: BlockTransfer, stream: Any = None) -> None:
        ns = client.namespace
        try:
            slots = client.request(p.PrepareStore(namespace=ns, hashes=tr.hashes, nbytes=self._block_bytes),
                                   p.Slots).slots
        except DaemonError as e:
            if e.code == "shed":
                return  # the daemon is saturated: skip this save, the engine keeps going
            raise
        g2 = client.g2
        assert g2 is not None
        ok = True
        try:
            for slot, vblocks in zip(slots, tr.block_ids, strict=True):
                if slot is not None:
                    self._copy_blocks(g2.slot_tensor(slot, self._block_bytes), vblocks, False, stream is not None)
            if stream is not None:
                stream.synchronize()  # the bytes are in G2 before the daemon is told to commit them
        except BaseException:
            ok = False
            raise
        finally:
            client.request(p.CommitStore(namespace=ns, hashes=tr.hashes, ok=ok), p.Ack)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for pool in (getattr(self, "_loader", None), getattr(self, "_saver", None)):
            if pool is not None:
                pool.shutdown(wait=True)
        links = getattr(self, "_links", None) or [
            getattr(self, "_link", None), getattr(self, "_load_link", None), getattr(self, "_save_link", None)]
        for link in links:
            if link is not None:
                link.close()
