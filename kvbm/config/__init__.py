"""Typed configuration: YAML files in configs/ plus ``KVBM_*`` environment overrides.

Every section is a ``msgspec.Struct``; unknown keys and wrong types are rejected at load with an
error that names the field (``s3.max_concurrency: Expected `int`, got `str```). Modules: ``schema`` (one
``msgspec.Struct`` per section, sizes, default paths) and ``loader`` (the file, the environment, the checks
across fields); the names below are the config's API.
"""

from kvbm.config.loader import (  # noqa: F401  (re-exported: the config API is kvbm.config)
    NON_CONFIG_ENV,
    SEAWEED_GRPC_OFFSET,
    Source,
    _closest,
    check_embedded_port,
    env_fields,
    load_config,
    load_config_sources,
)
from kvbm.config.schema import (  # noqa: F401  (re-exported: the config API is kvbm.config)
    _UNITS,
    SIZE_FIELDS,
    SIZE_HINT,
    SIZE_RE,
    Config,
    DaemonConfig,
    DeviceConfig,
    DiskConfig,
    EmbeddedS3Config,
    FleetConfig,
    HostConfig,
    S3Config,
    TenantConfig,
    TransferConfig,
    _Redacted,
    default_cache_dir,
    default_endpoint,
    default_events_endpoint,
    default_run_dir,
    format_size,
    parse_size,
    size_field,
)
