"""KvbmConnector: kvbm embedded in vLLM (v1 KV-connector API) as an offload/onboard connector.

kvbm registers it with vLLM through the ``vllm.general_plugins`` entry point, so once kvbm is installed
next to vLLM it loads by name::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvbmConnector", "kv_role": "kv_both"}'

``kv_connector_extra_config`` is parsed once into :class:`ConnectorConfig` (``config``; unknown keys and
wrong types are errors naming the field). The parts, one module each:

* ``connector``: the class vLLM instantiates; it builds one side by role and delegates every hook to it.
* ``scheduler`` (EngineCore process): asks the daemon for the longest stored prefix of each new request,
  hands the worker side the vLLM block ids to fill (loads) and the full blocks to save (``metadata``), and
  reports the connector's health in ``kv_transfer_params`` when a request finishes.
* ``worker`` (one per TP rank): runs those loads and saves, async on their own threads by default;
  ``paged`` copies whole vLLM blocks of every layer between the paged KV cache and the daemon's G2 slots
  (shared memory) as the engine stores them; the daemon cascades them to disk and S3.
* ``geometry``: a kvbm block spans ``k`` vLLM blocks and is keyed by vLLM's own hash of its last vLLM block.
  ``k`` is read from the daemon when the connector first reaches it (its G2 slot size); a vLLM block bigger
  than the daemon's blocks is reported in ``kv_transfer_params`` and logged once with what to change.
* ``fingerprint``: the layout of each worker (TP rank and PP stage; under MLA one per TP group; cache dtype,
  attention backend / CPU ISA, block size), whose fingerprint is in the namespace.
* ``groups``: vLLM's KV-cache groups (``SupportsHMA``): full attention, MLA and sliding window are stored;
  any other kind is an error at startup.
* ``link``: the daemon sessions. Every kvbm failure (daemon down, a checksum miss, S3 down) turns into a
  miss or a load error that vLLM recomputes (``kv_load_failure_policy`` becomes ``recompute`` unless the
  config asks for ``fail``); it is logged once and never raises into the engine.

vLLM's own offloading (``OffloadingConnector`` + ``TieringOffloadingSpec``) takes kvbm as a secondary tier below
its CPU tier instead: ``native_tier.KvbmTier`` (loaded by vLLM through ``module_path``; not imported here),
configured by ``native_config``, keyed by ``native_keys``, its removals from ``native_events``
(docs/native-tier.md).

Importing this package imports neither torch nor vLLM: each name below loads its module on first use, so
``kvbm.integrations.vllm.config`` (and kvbm's tests of it) work where vLLM is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module of this package that defines it (loaded on first access: PEP 562)
_WHERE = {
    "BlockTransfer": "metadata", "ConnectorConfig": "config", "Geometry": "geometry", "KvbmConnector": "connector",
    "KvbmConnectorMetadata": "metadata", "Link": "link", "Links": "link", "MisconfiguredError": "geometry",
    "SchedulerSide": "scheduler", "WorkerSide": "worker", "curve_options": "config",
    "daemon_block_bytes": "geometry", "kv_backend": "fingerprint", "kv_cache_dtype": "fingerprint",
    "layout_for": "fingerprint",
}
__all__ = [
    "BlockTransfer", "ConnectorConfig", "Geometry", "KvbmConnector", "KvbmConnectorMetadata", "Link", "Links",
    "MisconfiguredError", "SchedulerSide", "WorkerSide", "curve_options", "daemon_block_bytes", "kv_backend",
    "kv_cache_dtype", "layout_for",
]

if TYPE_CHECKING:
    from kvbm.integrations.vllm.config import ConnectorConfig, curve_options
    from kvbm.integrations.vllm.connector import KvbmConnector
    from kvbm.integrations.vllm.fingerprint import kv_backend, kv_cache_dtype, layout_for
    from kvbm.integrations.vllm.geometry import Geometry, MisconfiguredError, daemon_block_bytes
    from kvbm.integrations.vllm.link import Link, Links
    from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata
    from kvbm.integrations.vllm.scheduler import SchedulerSide
    from kvbm.integrations.vllm.worker import WorkerSide


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
