"""Loading the config: the YAML file (default: the packaged configs/default.yaml), ``KVBM_*`` environment
overrides, and the checks across fields; every error names the field (or the variable)."""

from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvbm.blocks.keys import SLUG_MAX, is_namespace
from kvbm.config.globs import may_name_slug, overlap
from kvbm.config.schema import Config, TenantConfig
from kvbm.errors import ConfigError

_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}

# ``KVBM_*`` variables that are not config overrides: the one list of them (any other ``KVBM_*`` variable
# must name a config field, so a misspelled override is an error instead of silently ignored).
NON_CONFIG_ENV: dict[str, str] = {
    "KVBM_CONFIG": "config file (--config)",
    "KVBM_DAEMON": "daemon endpoint of the CLI commands (--daemon) and the vLLM connector",
    "KVBM_LOG_LEVEL": "log level of the CLI",
    "KVBM_WEED": "path of the SeaweedFS `weed` binary",
    "KVBM_PYTHON": "python of scripts/seaweedfs.sh",
    "KVBM_EXTRAS": "extras of scripts/install.sh and scripts/test.sh",
    "KVBM_REQUIRE": "CI: features the test run must not skip",
    "KVBM_HIDE": "tests: optional packages to hide from the run (tests/hide/sitecustomize.py)",
    "KVBM_STRESS_S": "seconds of the slot stress test (tests/integration/test_slots.py)",
    "KVBM_BENCH_PEER_PYTHON": "python of the LMCache peer in `kvbm bench tiers --peer-python`",
}

Source = str  # "default", "file" or "env KVBM_..."


def _is_section(typ: Any) -> bool:
    return isinstance(typ, type) and issubclass(typ, msgspec.Struct)


def env_fields() -> dict[str, tuple[str, ...]]:
    """Every override variable -> the config path it sets (``KVBM_S3_ENDPOINT`` -> ``("s3", "endpoint")``)."""
    out: dict[str, tuple[str, ...]] = {}
    for f in msgspec.structs.fields(Config):
        if _is_section(f.type):
            for sub in msgspec.structs.fields(f.type):
                out[f"KVBM_{f.name}_{sub.name}".upper()] = (f.name, sub.name)
        else:
            out[f"KVBM_{f.name}".upper()] = (f.name,)
    return out


def _closest(name: str, candidates: Any) -> str:
    """`` did you mean X?`` for the nearest candidate, or nothing when none is close."""
    best = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {best[0]}?" if best else ""


def _env_overrides(data: dict[str, Any], environ: dict[str, str], sources: dict[str, Source]) -> None:
    """Apply ``KVBM_<SECTION>_<FIELD>`` (or ``KVBM_<FIELD>`` for top-level fields) to ``data``.

    A ``KVBM_*`` variable that is neither an override nor in :data:`NON_CONFIG_ENV` is an error naming the
    closest valid variable."""
    fields = env_fields()
    types = {f.name: f.type for f in msgspec.structs.fields(Config)}
    for env_key in sorted(environ):
        if not env_key.startswith("KVBM_") or env_key in NON_CONFIG_ENV:
            continue
        path = fields.get(env_key)
        if path is None:
            raise ConfigError(f"{env_key}: unknown{_closest(env_key, [*fields, *NON_CONFIG_ENV])}")
        raw, dotted = environ[env_key], ".".join(path)
        if len(path) == 1:
            data[path[0]] = _coerce(raw, types[path[0]], dotted, env_key)
        else:
            sec = data.get(path[0])
            if not isinstance(sec, dict):
                sec = data[path[0]] = {}
            typ = {f.name: f.type for f in msgspec.structs.fields(types[path[0]])}[path[1]]
            sec[path[1]] = _coerce(raw, typ, dotted, env_key)
        sources[dotted] = f"env {env_key}"


def _check_fields(data: dict[str, Any], source: str) -> None:
    """Unknown YAML fields are errors naming the closest valid field (``s3.endpiont``: ``s3.endpoint``)."""
    top = {f.name: f.type for f in msgspec.structs.fields(Config)}
    for key, value in data.items():
        if key not in top:
            raise ConfigError(f"{source}: {key}: unknown field{_closest(str(key), top)}")
        if _is_section(top[key]) and isinstance(value, dict):
            names = [f.name for f in msgspec.structs.fields(top[key])]
            for sub in value:
                if sub not in names:
                    near = _closest(str(sub), names).replace("mean ", f"mean {key}.")
                    raise ConfigError(f"{source}: {key}.{sub}: unknown field{near}")


def _coerce(raw: str, typ: Any, field: str, env_key: str) -> Any:
    if typ is bool:
        low = raw.strip().lower()
        if low in _BOOL_TRUE:
            return True
        if low in _BOOL_FALSE:
            return False
        raise ConfigError(f"{field} (from ${env_key}): expected a boolean, got {raw!r}")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{field} (from ${env_key}): expected an integer, got {raw!r}") from None
    if typ is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{field} (from ${env_key}): expected a number, got {raw!r}") from None
    if getattr(typ, "__origin__", None) is list:
        if _is_section(typ.__args__[0]):  # a list of sections (daemon.tenants): YAML/JSON flow syntax
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"{field} (from ${env_key}): not valid YAML: {e}") from None
            if not isinstance(value, list):
                raise ConfigError(f"{field} (from ${env_key}): expected a list, e.g. [{{name: a, token_file: F}}]")
            return value
        return [s for s in (p.strip() for p in raw.split(",")) if s]
    return raw  # str, size strings, literals: validated by msgspec below


SEAWEED_GRPC_OFFSET = 10000  # SeaweedFS's gRPC port of a server on port P is P + 10000 (kvbm.s3server.ports)


def check_embedded_port(port: int, field: str = "port") -> None:
    """A fixed port of the embedded SeaweedFS must leave room for its gRPC port; 0 picks free ports."""
    top = 65535 - SEAWEED_GRPC_OFFSET
    if port == 0 or 1 <= port <= top:
        return
    grpc = f" (its gRPC port {port + SEAWEED_GRPC_OFFSET} would be past 65535)" if port > top else ""
    raise ConfigError(f"{field}: {port} is out of range{grpc}: SeaweedFS also listens on port + "
                      f"{SEAWEED_GRPC_OFFSET} for gRPC, so it must be 0 (any free port) or 1-{top}")


def _validate(cfg: Config) -> Config:
    # Sizes were parsed (and checked >= 0) as the sections were built: schema.size_field.
    if cfg.block_nbytes <= 0:
        raise ConfigError("block_bytes: must be positive")
    if cfg.s3.max_concurrency < 1:
        raise ConfigError("s3.max_concurrency: must be >= 1")
    if cfg.s3.max_owed_blocks < 0:
        raise ConfigError("s3.max_owed_blocks: must be >= 0")
    if cfg.s3.copy_max_age_s < 0:
        raise ConfigError("s3.copy_max_age_s: must be >= 0")
    if cfg.s3.shard_chars not in range(0, 5):
        raise ConfigError("s3.shard_chars: must be between 0 and 4")
    if len(cfg.s3.bucket) < 3:
        raise ConfigError(f"s3.bucket: {cfg.s3.bucket!r} is shorter than 3 characters")
    if cfg.daemon.quarantine_grace_s is not None and cfg.daemon.quarantine_grace_s < 0:
        raise ConfigError("daemon.quarantine_grace_s: must be >= 0")
    if cfg.daemon.max_workers < 1:
        raise ConfigError("daemon.max_workers: must be >= 1")
    if cfg.daemon.max_inflight_per_client < 1:
        raise ConfigError("daemon.max_inflight_per_client: must be >= 1")
    if cfg.daemon.fair_burst < 1:
        raise ConfigError("daemon.fair_burst: must be >= 1")
    if cfg.daemon.max_session_slots < 0:
        raise ConfigError("daemon.max_session_slots: must be >= 0 (0: the principal's budget over the engine's ranks)")
    check_embedded_port(cfg.embedded_s3.port, "embedded_s3.port")
    _validate_tenants(cfg.daemon.tenants)
    _validate_discovery(cfg)
    return cfg


def _validate_tenants(tenants: list[TenantConfig]) -> None:
    seen: set[str] = set()
    for i, t in enumerate(tenants):
        at = f"daemon.tenants[{i}]"
        if not t.name or t.name in seen:
            raise ConfigError(f"{at}.name: {t.name!r} is empty or names another tenant too")
        seen.add(t.name)
        if not t.token_file:
            raise ConfigError(f"{at}.token_file: a tenant needs a token file")
        if not t.models and not t.namespaces:
            raise ConfigError(f"{at}.models: tenant {t.name!r} may register nothing (set models or namespaces)")
        if t.max_workers < 1:
            raise ConfigError(f"{at}.max_workers: must be >= 1")
        if t.max_inflight < 1:
            raise ConfigError(f"{at}.max_inflight: must be >= 1")
        if t.max_slots < 0:
            raise ConfigError(f"{at}.max_slots: must be >= 0 (0: an equal share of G2)")
    _refuse_shared_namespaces(tenants)


def _refuse_shared_namespaces(tenants: list[TenantConfig]) -> None:
    """Two tenants whose ``models`` patterns both match some model name (or who list one namespace) would
    share its namespaces: each could read and overwrite the other's blocks. Refused, naming both."""
    for j, tj in enumerate(tenants):
        for i, ti in enumerate(tenants[:j]):
            for y in tj.models:
                for x in ti.models:
                    if overlap(x, y):
                        raise ConfigError(
                            f"daemon.tenants[{j}].models: {y!r} of tenant {tj.name!r} overlaps {x!r} of tenant "
                            f"{ti.name!r} (daemon.tenants[{i}].models): a model both match would put both in one "
                            f"namespace, reading and overwriting each other's blocks; make the patterns disjoint")
            for ns in set(tj.namespaces) & set(ti.namespaces):
                raise ConfigError(f"daemon.tenants[{j}].namespaces: {ns!r} of tenant {tj.name!r} is also tenant "
                                  f"{ti.name!r}'s (daemon.tenants[{i}].namespaces): a namespace has one tenant")
    for j, tj in enumerate(tenants):
        for i, ti in enumerate(tenants):
            if i != j:
                _refuse_listed_in_glob(tj, j, ti, i)


def _refuse_listed_in_glob(owner: TenantConfig, j: int, other: TenantConfig, i: int) -> None:
    """A namespace ``owner`` lists whose model slug one of ``other``'s ``models`` may produce: ``other`` could
    register that model and land in ``owner``'s namespace. The slug is lossy (case, truncation), so this
    catches what it can show; Register refuses every such namespace whatever this misses."""
    for ns in owner.namespaces:
        if not is_namespace(ns):
            raise ConfigError(f"daemon.tenants[{j}].namespaces: {ns!r} is not a kvbm namespace "
                              f"(<model-slug>-<16 hex fingerprint>, as Registered and kvbm status name it)")
        slug = ns.rsplit("-", 1)[0]
        for pattern in other.models:
            if may_name_slug(pattern, slug, truncated=len(slug) >= SLUG_MAX):
                raise ConfigError(
                    f"daemon.tenants[{j}].namespaces: {ns!r} of tenant {owner.name!r} may be the namespace of a "
                    f"model matching {pattern!r} of tenant {other.name!r} (daemon.tenants[{i}].models): "
                    f"{other.name!r} could register it and read and overwrite {owner.name!r}'s blocks; make the "
                    f"pattern exclude that model")


def _validate_discovery(cfg: Config) -> None:
    dc = cfg.daemon
    if not dc.discovery:
        return
    if not cfg.s3.enabled:
        raise ConfigError("daemon.discovery: needs s3.enabled (members announce themselves in the shared bucket)")
    if not dc.events_endpoint:
        raise ConfigError("daemon.discovery: needs daemon.events_endpoint (what the other members subscribe to)")
    if not dc.discovery_interval_s > 0:
        raise ConfigError("daemon.discovery_interval_s: must be > 0")
    if not dc.discovery_ttl_s > dc.discovery_interval_s:
        raise ConfigError(f"daemon.discovery_ttl_s: must be longer than daemon.discovery_interval_s "
                          f"({dc.discovery_ttl_s} <= {dc.discovery_interval_s}): members would expire between scans")
    ep = dc.announce_endpoint
    if ep and not re.match(r"^(tcp|ipc)://.+", ep):
        raise ConfigError(f"daemon.announce_endpoint: {ep!r} is not a tcp:// or ipc:// endpoint")


def load_config(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Load ``path`` (default: the packaged configs/default.yaml), apply ``KVBM_*`` env, validate."""
    return load_config_sources(path, environ)[0]


def load_config_sources(
    path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None
) -> tuple[Config, dict[str, Source]]:
    """:func:`load_config`, plus where each set field came from: ``file`` or ``env KVBM_...`` (fields
    missing from the result are defaults; the packaged default.yaml counts as defaults)."""
    environ = dict(os.environ if environ is None else environ)
    if path is None and environ.get("KVBM_CONFIG"):
        path = environ["KVBM_CONFIG"]
    if path is None:
        text = resources.files("kvbm.configs").joinpath("default.yaml").read_text()
        source = "configs/default.yaml"
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        source = str(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    _check_fields(data, source)
    sources: dict[str, Source] = {}
    if path is not None:
        for key, value in data.items():
            if isinstance(value, dict):
                sources.update((f"{key}.{sub}", "file") for sub in value)
            else:
                sources[key] = "file"
    _env_overrides(data, environ, sources)
    try:
        cfg = msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_field_message(e)}") from None
    return _validate(cfg), sources


def _field_message(e: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.s3.max_concurrency`"; put the field first.
    msg = str(e)
    m = re.search(r"- at `\$\.?(.*)`$", msg)
    if m:
        return f"{m.group(1) or '<root>'}: {msg[: m.start()].strip()}"
    return msg
