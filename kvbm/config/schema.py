"""The config's schema: one ``msgspec.Struct`` per section, sizes and default paths (loaded by :mod:`kvbm.config`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import msgspec

from kvbm.config.fleet import FleetConfig
from kvbm.errors import ConfigError

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


SIZE_HINT = "e.g. 8MiB, 2GB, 4096"


def human_bytes(n: float) -> str:
    """``n`` bytes as people read them (``8.0 MiB``): the other way round from :func:`parse_size`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(value: int | str, field: str = "size") -> int:
    """``8MiB`` / ``2 GB`` / ``4096`` -> bytes."""
    if isinstance(value, int):
        return value
    m = SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"{field}: cannot read {value!r} as a size ({SIZE_HINT})")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


# The size fields (bytes once built; YAML and env may spell them "8MiB"): parsed by size_field, printed by
# format_size in `kvbm config show`.
SIZE_FIELDS = frozenset({"block_bytes", "device.capacity", "host.capacity", "disk.capacity", "s3.capacity",
                         "embedded_s3.min_free_disk"})


def size_field(value: int | str, field: str) -> int:
    """A size field's bytes, parsed where the config is built (``__post_init__`` of its section): every
    ``*.capacity`` and ``block_bytes`` is an ``int`` after loading, whatever the YAML or env spelled."""
    n = parse_size(value, field)
    if n < 0:
        raise ConfigError(f"{field}: must be >= 0")
    return n


def format_size(n: int) -> str:
    """The shortest exact spelling of ``n`` bytes (``3GiB``, ``2GB``, ``1000``), as ``kvbm config show`` prints."""
    units = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024),
             ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000))
    exact = [f"{n // size}{unit}" for unit, size in units if n and n % size == 0]
    return min(exact, key=len, default=str(n))  # the fewest digits; binary units first on a tie


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbm"


def default_run_dir() -> Path:
    """The daemon's default socket directory, ``<cache dir>/run``: the daemon keeps it 0700, so only its own
    user (and root) can connect to the sockets inside (see kvbm.security)."""
    return default_cache_dir() / "run"


def default_endpoint() -> str:
    return f"ipc://{default_run_dir() / 'kvbm.sock'}"


def default_events_endpoint() -> str:
    return f"ipc://{default_run_dir() / 'events.sock'}"


class _Redacted(msgspec.Struct):
    """A config section whose repr masks secret-named fields (see kvbm.redact)."""

    def __repr__(self) -> str:
        from kvbm.redact import MASK, is_secret_name

        parts = []
        for name in self.__struct_fields__:
            value = getattr(self, name)
            parts.append(f"{name}={MASK if is_secret_name(name) and value not in ('', None) else repr(value)}")
        return f"{type(self).__name__}({', '.join(parts)})"


class DeviceConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """G1: device memory (CUDA when available, else CPU tensors stand in)."""

    enabled: bool = True
    capacity: int | str = "256MiB"  # bytes once built (a size string in YAML/env)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"

    def __post_init__(self) -> None:
        self.capacity = size_field(self.capacity, "device.capacity")


class HostConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """G2: a pool of fixed-size slots in shared memory (pinned on CUDA hosts)."""

    enabled: bool = True
    capacity: int | str = "1GiB"  # bytes once built (a size string in YAML/env)
    shm_name: str = ""  # empty: a unique name per process
    pin: bool = True

    def __post_init__(self) -> None:
        self.capacity = size_field(self.capacity, "host.capacity")


class DiskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """G3: one file per block under ``dir``."""

    enabled: bool = True
    dir: str = ""  # empty: <cache dir>/disk
    capacity: int | str = "16GiB"  # bytes once built (a size string in YAML/env)
    o_direct: bool = True
    fsync: bool = True
    # G2->G3 frequency filter (as Dynamo's): only blocks read at least this often are written down.
    min_hits_to_offload: int = 0

    def __post_init__(self) -> None:
        self.capacity = size_field(self.capacity, "disk.capacity")


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Placement policy (kvbm.manager.placement): which blocks a full tier lets go of, and what a hit keeps."""

    eviction: Literal["lru", "frequency"] = "lru"  # frequency: reference classes with ageing (docs/traces.md)
    age0_s: float = 600.0  # frequency: seconds of waiting that halve a fresh block's hit density
    ghost_blocks: int = 1 << 20  # frequency: reference counts remembered (blocks that left every tier too)


class S3Config(_Redacted, forbid_unknown_fields=True, kw_only=True):
    """G4: S3-compatible object storage."""

    enabled: bool = True
    endpoint: str = ""  # empty: the embedded SeaweedFS
    region: str = "us-east-1"
    bucket: str = "kvbm"
    prefix: str = "kvbm"
    access_key: str = ""  # empty: env / AWS credential chain
    secret_key: str = ""
    session_token: str = ""
    addressing: Literal["path", "virtual"] = "path"
    verify_tls: bool = True
    create_bucket: bool = True
    capacity: int | str = "1TiB"  # bytes once built (a size string in YAML/env)
    client: Literal["aiobotocore", "http", "nixl"] = "http"  # block bodies; control calls use aiobotocore
    max_concurrency: int = 8
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 30.0
    max_retries: int = 3
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    max_pending_writes: int = 64
    shard_chars: int = 2
    # SigV4 hashes every PUT body with SHA-256 over plain http (about 1.5 client CPU-s/GB). kvbm blocks carry
    # their own checksum, verified on every read, so by default the body is sent as UNSIGNED-PAYLOAD (as
    # botocore already does over https). Set true to sign bodies over http too.
    sign_payload: bool = False
    # List the bucket at start() to fill the index. Off by default: BlockManager.start(index=True)
    # already scans every tier, and CLI commands that only list/purge need no index.
    scan_on_start: bool = False
    # Deadline for one NIXL OBJ transfer (aws-sdk-cpp itself retries a dead endpoint for ~25 s).
    nixl_timeout_s: float = 10.0
    # LIST requests in flight at once when a namespace is listed by shard directory (re-index, status, purge).
    list_concurrency: int = 16
    # How long a block this node saw in the bucket (its own PUT, a GET, a HEAD, a listing) counts as a real copy
    # when a durable store or a disk eviction relies on it; an older sighting (or a peer's event alone) is HEADed
    # again first, since another node may have purged it since.
    copy_max_age_s: float = 30.0
    # Write-throughs owed to S3 while it is down or shedding (kvbm.manager.owed) at most; beyond, blocks stay on
    # disk only.
    max_owed_blocks: int = 1_000_000

    def __post_init__(self) -> None:
        self.capacity = size_field(self.capacity, "s3.capacity")


class EmbeddedS3Config(_Redacted, forbid_unknown_fields=True, kw_only=True):
    """The local SeaweedFS that the default config starts."""

    enabled: bool = True
    dir: str = ""  # empty: <cache dir>/seaweedfs
    port: int = 0  # 0: pick a free port
    access_key: str = "kvbm"
    secret_key: str = ""  # empty: a random secret per data dir, kept 0600 in its identity.json
    # Free disk space under which it refuses writes: an absolute floor, not SeaweedFS's 1% of the disk.
    min_free_disk: int | str = "256MiB"

    def __post_init__(self) -> None:
        self.min_free_disk = size_field(self.min_free_disk, "embedded_s3.min_free_disk")


class TransferConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How bytes move: NIXL (UCX for memory, POSIX for files) or plain copies/pread/pwrite."""

    backend: Literal["auto", "nixl", "plain"] = "auto"
    io_threads: int = 4


class TenantConfig(_Redacted, forbid_unknown_fields=True, kw_only=True):
    """One tenant of a shared daemon: its token names what it may register and bounds what it may hold.

    ``kvbm serve`` creates ``token_file`` (random, 0600) at first start if missing; hand a copy to the tenant,
    whose clients present it (``daemon.tenant_token_file``, the connector's ``tenant_token_file``)."""

    name: str
    token_file: str
    models: list[str] = []  # fnmatch patterns of the layout.model names it may register ("team-a/*")
    namespaces: list[str] = []  # exact layout namespaces it may register (as Registered and kvbm status name them)
    max_workers: int = 64  # its registered workers at most (its own budget, apart from daemon.max_workers)
    max_inflight: int = 256  # its requests handled at once; beyond it a request is answered `busy` at once
    # G2 slots its sessions hold at once (pinned by Onboard + prepared by PrepareStore, until Release/commit);
    # beyond it a slot request is answered `full`. 0: an equal share, G2's slots over the number of tenants.
    max_slots: int = 0


class DaemonConfig(_Redacted, forbid_unknown_fields=True, kw_only=True):
    # Default: ipc:// sockets in <cache dir>/run (0700): only the daemon's user may connect or subscribe.
    endpoint: str = msgspec.field(default_factory=default_endpoint)
    events_endpoint: str = msgspec.field(default_factory=default_events_endpoint)
    metrics_port: int = 9464  # 0 disables
    request_timeout_s: float = 10.0
    max_message_bytes: int = 4 * 1024 * 1024
    max_queue: int = 256
    vllm_events: list[str] = []  # vLLM KV-event endpoints to subscribe to
    vllm_replay: list[str] = []  # their replay endpoints, by position ("" or missing: no replay)
    vllm_events_mode: Literal["auto", "bind", "connect"] = "auto"  # auto: bind tcp (vLLM connects), connect ipc
    metrics_host: str = "127.0.0.1"
    worker_timeout_s: float = 60.0  # a silent worker's pins and unfinished stores are released after this
    # How long the G2 slots of a worker whose lease expired stay quarantined at most (it may still be copying).
    quarantine_grace_s: float | None = None  # None: max(30 s, 2 x worker_timeout_s)
    max_workers: int = 1024  # registered workers at most (admin sessions aside); beyond it Register gets `limit`
    barrier_timeout_s: float = 30.0  # a Barrier's timeout when it names none, and the most it may name
    max_inflight: int = 1024  # requests handled at once; beyond it the daemon stops reading (ZMQ backpressure)
    # One client's requests handled at once (a worker session, else a connection; a tenant has its own
    # max_inflight): beyond it that client's request is answered `busy` at once, so a flood leaves others served.
    max_inflight_per_client: int = 256
    # Handlers one client (a tenant, else a session) starts per event-loop turn; its requests past it wait in its
    # own queue, served round-robin with other clients' (kvbm.daemon.fairness): another's request waits for at
    # most this many of each client's, not their whole backlog. Nothing is refused for it.
    fair_burst: int = 4
    # G2 slots one session holds at once (pinned + prepared), stated to it in Registered.session_slots; beyond it
    # a slot request is answered `full`. 0: its principal's budget (a tenant's max_slots, else all of G2) over
    # the engine's ranks (the Register's tp_size x its layout's pp_size), so the ranks of one engine together fit.
    max_session_slots: int = 0
    # Tenants (empty: one tenant, anyone who can reach the sockets). With tenants, a Register needs a tenant's
    # token (or the admin token) and may only name that tenant's models/namespaces; see TenantConfig.
    tenants: list[TenantConfig] = []
    tenant_token_file: str = ""  # clients: the tenant token this client registers with
    # CURVE (encryption + client authentication) on the request and events sockets; see kvbm.security.
    curve_secret_key: str = ""  # Z85; set with curve_public_key (or use curve_server_key_file)
    curve_public_key: str = ""  # Z85; clients (CLI, connector) need it to reach a CURVE daemon
    curve_server_key_file: str = ""  # the daemon's keypair file (`kvbm keys generate`), instead of the Z85 fields
    curve_clients_dir: str = ""  # allow-list: directory of allowed clients' public key files (<name>.key)
    # On a daemon with tenants and CURVE: the public keys that may subscribe to the events socket (the operator's
    # monitors, fleet peers with their own key pair); the daemon's own key always may, tenants' keys never.
    curve_admin_clients_dir: str = ""
    curve_allow_any_client: bool = False  # CURVE without curve_clients_dir: encrypt only, authenticate nobody
    curve_client_key_file: str = ""  # clients: own keypair file (<name>.key_secret) for an allow-listed daemon
    # Admin credential (Evict, Reindex, other namespaces, resident hashes): created 0600 at the first `kvbm serve`.
    admin_token_file: str = ""  # empty: <cache dir>/admin.token
    allow_insecure_tcp: bool = False  # allow a non-loopback TCP bind without CURVE
    log_format: Literal["json", "text"] = "json"
    # When the daemon learns what the bucket holds: "start" lists all of it before serving; "background" serves
    # at once and lists in the background (a registering worker's namespace is listed first, before its
    # Registered reply); "lazy" only lists the namespaces of workers that register.
    index_bucket: Literal["start", "background", "lazy"] = "background"
    # How long a Register waits for its namespace's first bucket listing (a slow S3); then it is answered and the
    # listing goes on in the background (lookups find the namespace's G4 blocks as it lands).
    register_index_wait_s: float = 5.0
    prefetch: bool = True  # a lookup that hits G3/G4 starts bringing the blocks up to G2
    max_prefetch: int = 16  # prefetches in flight at once; more lookups are not prefetched
    # Fleet: many daemons sharing one bucket (same s3.bucket and s3.prefix). See kvbm.fleet.
    peers: list[str] = []  # other daemons' events_endpoint (tcp://node-a:5558): their G4 stores/removals are learned
    peer_curve_server_key: str = ""  # Z85 public key of the peers' PUB sockets (empty: curve_public_key)
    # A peer with tenants and no CURVE lets only its admin token subscribe to its events (ZeroMQ PLAIN, sent in
    # clear): the file holding that token. Empty: such peers cannot be followed (their status says so).
    peer_token_file: str = ""
    # Where the token goes: a member discovery found only when its announced events endpoint is listed here (anyone
    # who can write the bucket prefix can announce an endpoint asking for PLAIN); a daemon.peers entry when listed
    # here, or every one while this list is empty.
    peer_token_endpoints: list[str] = []
    probe: bool = True  # a lookup that misses probes the bucket (HEAD) for the next blocks of its prefix
    probe_budget_ms: float = 30.0  # how long a lookup waits for its probe; the rest is learned for the next lookup
    probe_concurrency: int = 8  # HEADs in flight per probe (blocks are probed in windows of this many)
    probe_max_blocks: int = 64  # blocks one probe asks about at most
    probe_negative_ttl_s: float = 1.0  # a block the bucket lacked is not probed again for this long
    probe_negative_max: int = 100_000  # entries of the negative cache (the oldest leave first)
    # Discovery (kvbm.fleet.members): announce this daemon in the bucket ({s3.prefix}/_members/{node_id}.json:
    # events endpoint, CURVE public key, expiry) and follow every other daemon announced there, with or
    # without a static `peers` list. Needs G4 and an events_endpoint; give every daemon its own node_id.
    discovery: bool = False
    discovery_interval_s: float = 2.0  # how often the members directory is listed (joins/leaves seen within this)
    discovery_ttl_s: float = 15.0  # a membership not refreshed for this long is dropped; refreshed every ttl/3
    announce_endpoint: str = ""  # the events endpoint others connect to; empty: the bound one (0.0.0.0: the FQDN)
    # Fleet-wide recency: every this many seconds the daemon writes the hashes hit since the last write to
    # {s3.prefix}/_access/{namespace}/{node}/{epoch}.log (kvbm.fleet.recency); purge and prewarm read them. 0: off.
    access_log_interval_s: float = 300.0
    node_id: str = ""  # names this node's access logs; empty: the host name
    # Join warm: before /readyz says ready, pull the fleet's prewarm_hottest most recently used blocks of each
    # namespace (prewarm_namespaces, or every namespace with access logs) from the bucket into prewarm_to. 0: off.
    prewarm_hottest: int = 0
    prewarm_to: Literal["G2", "G3"] = "G3"
    prewarm_namespaces: list[str] = []


class RouterEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """kvbm's block residency per tier as vLLM KV events for KV-aware routers (:mod:`kvbm.daemon.router_events`)."""

    endpoint: str = ""  # the PUB socket routers subscribe to (tcp://127.0.0.1:5557, ipc://...); empty: off
    replay_endpoint: str = ""  # a ROUTER socket answering vLLM's replay requests; empty: no replay
    buffer_steps: int = 10_000  # batches kept for replay (the first ones: every block held when the daemon bound)
    topic: str = ""  # the first frame of every message, as vLLM's kv_events_config.topic (llm-d: kv@<pod>@<model>)
    namespaces: list[str] = []  # only these layout namespaces (one model's stream); empty: every namespace
    int_hashes: bool = False  # hashes as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: the low 64 bits, big-endian

    def __post_init__(self) -> None:
        for field, ep in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if ep and not ep.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"router_events.{field}: {ep!r} is not a tcp:// or ipc:// endpoint")
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError("router_events.replay_endpoint: needs router_events.endpoint (what it replays)")
        if self.replay_endpoint and self.replay_endpoint == self.endpoint:
            raise ConfigError("router_events.replay_endpoint: must differ from router_events.endpoint")
        if self.buffer_steps < 1:
            raise ConfigError("router_events.buffer_steps: must be >= 1")


class Config(_Redacted, forbid_unknown_fields=True, kw_only=True):
    block_bytes: int | str = "8MiB"  # bytes once built (a size string in YAML/env)
    hash_scheme: Literal["kvbm", "vllm"] = "kvbm"
    device: DeviceConfig = msgspec.field(default_factory=DeviceConfig)
    host: HostConfig = msgspec.field(default_factory=HostConfig)
    disk: DiskConfig = msgspec.field(default_factory=DiskConfig)
    s3: S3Config = msgspec.field(default_factory=S3Config)
    embedded_s3: EmbeddedS3Config = msgspec.field(default_factory=EmbeddedS3Config)
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    router_events: RouterEventsConfig = msgspec.field(default_factory=RouterEventsConfig)
    fleet: FleetConfig = msgspec.field(default_factory=FleetConfig)  # peer reads (kvbm.config.fleet)

    def __post_init__(self) -> None:
        self.block_bytes = size_field(self.block_bytes, "block_bytes")

    @property
    def block_nbytes(self) -> int:
        return int(self.block_bytes)

    @property
    def disk_dir(self) -> Path:
        return Path(self.disk.dir) if self.disk.dir else default_cache_dir() / "disk"
