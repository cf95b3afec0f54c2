"""The kvbm tier's entry in vLLM's ``secondary_tiers``: parsed once into :class:`NativeTierConfig`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from kvbm.config import _closest, default_endpoint
from kvbm.errors import ConfigError

PREFIX = "kv_connector_extra_config.secondary_tiers[kvbm]"
# What vLLM's SecondaryTierFactory passes through besides the tier's own keys.
_VLLM_KEYS = ("backpressure",)


class NativeTierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the tier's dict may set besides ``type`` and ``module_path``; every field is optional."""

    daemon: str | None = None  # the daemon's endpoint; else kvbm_config's, else $KVBM_DAEMON, else kvbm's default
    kvbm_config: str | None = None  # a kvbm config file: its daemon endpoint and client credentials
    model_name: str | None = None  # else vLLM's model name
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # one daemon request at most (a dead daemon: ~1 ms)
    # A chunk whose lookup the daemon has not answered within this is a miss (vLLM computes the request).
    lookup_give_up_ms: Annotated[float, msgspec.Meta(ge=0)] = 500.0
    # Store jobs queued behind the store thread at most; more are dropped (and counted), never queued.
    max_queued_stores: Annotated[int, msgspec.Meta(ge=1)] = 64
    enable_kv_events: bool = False  # BlockStored/BlockRemoved events for kvbm's chunks (with vLLM's events on)
    # The daemon's block events (for BlockRemoved): else kvbm_config's daemon.events_endpoint, else kvbm's default.
    events_endpoint: str | None = None
    locality: Literal["LOCAL", "REMOTE"] | None = None
    stats_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # how often the daemon's tier figures are read
    curve_server_key: str | None = None
    curve_server_key_file: str | None = None
    curve_client_key_file: str | None = None
    tenant_token_file: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> NativeTierConfig:
        data = {k: v for k, v in extra.items() if k not in _VLLM_KEYS}
        for key in data:
            if key not in cls.__struct_fields__:
                raise ConfigError(f"{PREFIX}.{key}: unknown key{_closest(str(key), cls.__struct_fields__)}")
        try:
            cfg = msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            from kvbm.integrations.vllm.config import _field_message

            raise ConfigError(_field_message(e).replace("kv_connector_extra_config", PREFIX, 1)) from None
        if cfg.daemon and cfg.kvbm_config:
            raise ConfigError(f"{PREFIX}.daemon and kvbm_config: set one (kvbm_config names the endpoint)")
        return cfg

    def events(self) -> str:
        """The daemon's events endpoint this config names."""
        if self.events_endpoint:
            return self.events_endpoint
        if self.kvbm_config:
            from kvbm.config import load_config

            return load_config(self.kvbm_config).daemon.events_endpoint
        from kvbm.config import default_events_endpoint

        return default_events_endpoint()

    def client(self) -> tuple[str, dict[str, Any]]:
        """The daemon's endpoint and the WorkerClient keyword arguments (credentials) this config names."""
        if self.kvbm_config:
            from kvbm.client import client_options
            from kvbm.config import load_config

            dc = load_config(self.kvbm_config).daemon
            return dc.endpoint, client_options(dc)
        from kvbm.integrations.vllm.config import curve_options

        creds = {k: getattr(self, k) for k in ("curve_server_key", "curve_server_key_file", "curve_client_key_file",
                                               "tenant_token_file") if getattr(self, k)}
        endpoint = (self.daemon or os.environ.get("KVBM_DAEMON") or os.environ.get("KVBM_DAEMON_ENDPOINT")
                    or default_endpoint())
        return endpoint, curve_options(creds)


TIER_TYPE = "KvbmTier"  # the class vLLM's SecondaryTierFactory imports from TIER_MODULE
TIER_MODULE = "kvbm.integrations.vllm.native_tier"


def kv_transfer_config(cpu_bytes: int, **tier: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for its native offloading (``OffloadingConnector`` with
    ``TieringOffloadingSpec``: a CPU tier of ``cpu_bytes``) with kvbm's tier below it; ``tier``: the tier's keys
    (:class:`NativeTierConfig`)."""
    NativeTierConfig.parse(tier)  # a bad key is an error here, not in vLLM's engine process
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": int(cpu_bytes),
                                          "secondary_tiers": [{"type": TIER_TYPE, "module_path": TIER_MODULE,
                                                               **tier}]}}
