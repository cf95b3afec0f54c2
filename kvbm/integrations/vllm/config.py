"""The connector's ``kv_connector_extra_config``: parsed once into :class:`ConnectorConfig`, field-named errors."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from kvbm.config import _closest, default_endpoint
from kvbm.errors import ConfigError

PREFIX = "kv_connector_extra_config"


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``kv_connector_extra_config`` may set; every field is optional."""

    version: Literal[1] = 1  # bumped when a field changes meaning, so an old config is refused, not misread
    daemon: str | None = None  # the daemon's endpoint; else $KVBM_DAEMON, else kvbm serve's default (ipc, 0700)
    model_name: str | None = None  # else vLLM's served model name
    vllm_blocks_per_kvbm_block: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: derived from the daemon
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # A scheduler step waits at most this long in all for lookup answers; a request whose answer is not
    # there yet is asked again next step, and computed if none came within lookup_give_up_ms (a sync load's pins,
    # once its lookup is answered, within timeout_s: they bring blocks up from disk or S3).
    lookup_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    lookup_give_up_ms: Annotated[float, msgspec.Meta(ge=0)] = 500.0
    # A request whose lookup stops right before a block this engine is still saving (a conversation's next turn
    # arriving as the last one finished) is asked again for up to this long (vLLM skips it meanwhile, the engine
    # does not wait), then computed from there (kvbm.integrations.vllm.inflight). 0: never waits. An answer kvbm
    # could not give (a link down, a lookup given up) is never waited on.
    save_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 2000.0
    # A step whose kvbm hooks held the engine longer than this is logged (kvbm.integrations.vllm.hooks).
    hook_warn_ms: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # Before vLLM reuses blocks (a preempted request's, a sliding window's), saves of them not copying yet are
    # staged (copied to host buffers, within stage_mib); past the staging budget they are waited for at most this
    # long in all per step, then dropped: a stalled daemon costs a step no more.
    fence_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 50.0
    # A finished request's saves that have not read its blocks yet are copied to host buffers before vLLM reuses
    # them (kvbm never holds a finished request's blocks): at most this many MiB per step (a memcpy on a CPU
    # engine, a copy on the stream on a GPU), 4x that held in all; a save past it is dropped and counted.
    stage_mib: Annotated[float, msgspec.Meta(ge=0)] = 64.0
    save: bool = True
    load: bool = True
    # A finished request's tokens past its last full kvbm block, down to vLLM's block, are saved as a partial
    # block, and a hit continues into it (single-group models): a hit ends where vLLM's own would.
    partial_blocks: bool = True
    async_load: bool | None = None  # None: async on an accelerator, sync on a CPU engine (the connector resolves it)
    async_save: bool = True
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    curve_server_key: str | None = None  # the daemon's CURVE public key (Z85)
    curve_server_key_file: str | None = None  # ... or its .key file
    curve_client_key_file: str | None = None  # this engine's .key_secret file
    tenant_token_file: str | None = None  # a tenant's token (the daemon's daemon.tenants[].token_file, a copy)
    # The model weights' version (an RL trainer's step, a checkpoint id): part of every namespace, so engines
    # on the same weights share blocks and other weights never match. A reset of the connector's cache (a
    # weight update) starts a new epoch on top of it (kvbm.integrations.vllm.epoch).
    weights_version: str | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """``extra`` as a config; unknown keys and wrong types are ConfigErrors naming the field."""
        data = dict(extra or {})
        names = cls.__struct_fields__
        for key in data:
            if key not in names:
                raise ConfigError(f"{PREFIX}.{key}: unknown key{_closest(str(key), names)}")
        try:
            cfg = msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(_field_message(e)) from None
        if cfg.curve_client_key_file and not (cfg.curve_server_key or cfg.curve_server_key_file):
            raise ConfigError(f"{PREFIX}.curve_client_key_file needs curve_server_key(_file) too")
        return cfg

    def endpoint(self) -> str:
        return (self.daemon or os.environ.get("KVBM_DAEMON") or os.environ.get("KVBM_DAEMON_ENDPOINT")
                or default_endpoint())


def _field_message(e: msgspec.ValidationError) -> str:
    # msgspec says "Expected `int | null`, got `str` - at `$.k`"; put the field first, and leave out
    # "null": it means unset, the default.
    msg = str(e)
    m = re.search(r" - at `\$\.?(.*)`$", msg)
    field, msg = (m.group(1), msg[: m.start()]) if m else ("", msg)
    msg = msg.replace("`", "").replace(" | null", "")
    return f"{PREFIX}.{field}: {msg[:1].lower()}{msg[1:]}" if field else f"{PREFIX}: {msg}"


def curve_options(extra: ConnectorConfig | Mapping[str, Any]) -> dict[str, Any]:
    """WorkerClient keyword arguments for the credentials the config names: CURVE keys and the tenant token
    (reads their files)."""
    from kvbm.security import load_keypair, load_public_key, read_tenant_token

    cfg = extra if isinstance(extra, ConnectorConfig) else ConnectorConfig.parse(extra)
    server = cfg.curve_server_key or ""
    if not server and cfg.curve_server_key_file:
        server = load_public_key(cfg.curve_server_key_file).decode()
    key_file = cfg.curve_client_key_file
    return {"curve_server_key": server, "curve_keypair": load_keypair(key_file) if key_file else None,
            "tenant_token": read_tenant_token(cfg.tenant_token_file or "", f"{PREFIX}.tenant_token_file")}
