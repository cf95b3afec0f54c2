"""A chaos schedule's world: ``kvbm serve`` (G2 shared memory, G3 on a size-limited tmpfs where this machine lets
root mount one, G4 through :class:`~kvbm.chaos.proxy.FaultProxy` to a SeaweedFS) serving three tenants
(:func:`~kvbm.chaos.schedule.tenants_config`), each tenant's clients, and the bucket read straight (no proxy, no
daemon). Also what a schedule's run reports (:class:`ScheduleResult`)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbm.bench.common import delete_prefix
from kvbm.blocks import BlockKey
from kvbm.chaos.proxy import FaultProxy
from kvbm.chaos.schedule import SLOT_BYTES, Schedule, block_hash, content, layout_of, tenants_config
from kvbm.client import WorkerClient
from kvbm.config import S3Config
from kvbm.daemon.launch import DaemonLauncher, ipc_endpoint
from kvbm.errors import TierUnavailableError
from kvbm.tiers.s3 import make_s3_tier

JOURNAL = ".kvbm-owed.journal"
DISK_FS_BYTES = 6 * 1024 * 1024  # the tmpfs under G3 (the tier is told 4 MiB: a filler file makes it ENOSPC)


@dataclass
class S3Target:
    """The real S3 endpoint (SeaweedFS) the proxy forwards to, and its bucket and credentials."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str

    def hostport(self) -> tuple[str, int]:
        host, port = self.endpoint.split("//", 1)[1].rsplit(":", 1)
        return host, int(port)


@dataclass
class ScheduleResult:
    seed: int
    index_bucket: str
    seconds: float = 0.0
    ops: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    unavailable: int = 0  # requests that got no answer in time (expected while the daemon is stopped or killed)
    violations: list[dict[str, Any]] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)  # the ops run (the replay check compares them)
    end_wait_s: float = 0.0  # how long the end check waited for the acked blocks to be in the bucket

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def bump(d: dict[str, int], k: str, n: int = 1) -> None:
    d[k] = d.get(k, 0) + n


def sh(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def tmpfs_available() -> tuple[bool, str]:
    """Whether this process may mount a size-limited tmpfs (the disk faults need one), and why not."""
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True, text=True)
        if r.returncode:
            return False, f"cannot mount a tmpfs here: {r.stderr.strip()}"
        sh("umount", d)
    return True, ""


class World:
    """One schedule's daemon, proxy, disk and clients, in a fresh directory under ``root``."""

    def __init__(self, schedule: Schedule, s3: S3Target, root: Path) -> None:
        self.sched = schedule
        self.seed = schedule.seed
        self.s3 = s3
        self.tmp = Path(tempfile.mkdtemp(prefix=f"s{schedule.seed}-", dir=root))
        self.disk = self.tmp / "g3"
        self.disk.mkdir()
        self.prefix = f"chaos-{schedule.seed}-{self.tmp.name[-6:].lower().replace('_', 'x')}"
        self.proxy = FaultProxy(s3.hostport(), seed=schedule.seed)
        self.tmpfs = False
        self.clients: dict[tuple[str, int], WorkerClient] = {}
        self.admin: WorkerClient | None = None
        self.daemon: DaemonLauncher | None = None  # started by setup(): its config names the proxy's port
        self.nbytes = layout_of("a").block_nbytes

    # -- set-up -----------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "block_bytes": SLOT_BYTES, "device": {"enabled": False}, "host": {"capacity": "2MiB", "pin": False},
            "disk": {"dir": str(self.disk), "capacity": "4MiB", "fsync": False, "o_direct": False},
            "s3": {"endpoint": self.proxy.endpoint, "bucket": self.s3.bucket, "prefix": self.prefix,
                   "access_key": self.s3.access_key, "secret_key": self.s3.secret_key, "max_retries": 1,
                   "connect_timeout_s": 0.5, "read_timeout_s": 3.0, "breaker_failures": 3, "breaker_reset_s": 1.0},
            "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
            "daemon": {"endpoint": ipc_endpoint(self.tmp, "d.sock"),
                       "events_endpoint": ipc_endpoint(self.tmp, "ev.sock"),
                       "metrics_port": 0, "admin_token_file": str(self.tmp / "admin.token"),
                       "index_bucket": self.sched.index_bucket, "barrier_timeout_s": 1.0,
                       "worker_timeout_s": 30.0, "tenants": tenants_config(str(self.tmp))},
        }

    def setup(self) -> None:
        # A size-limited filesystem under G3 and the owed journal, where root may mount one.
        self.tmpfs = sh("mount", "-t", "tmpfs", "-o", f"size={DISK_FS_BYTES}", "tmpfs", str(self.disk))
        self.proxy.start()
        self.daemon = DaemonLauncher(self.tmp, self.config())
        self.daemon.start()

    def teardown(self) -> bool:
        """Close the clients, stop the daemon and the proxy, clean the bucket and the disk; whether the daemon
        stopped on SIGTERM."""
        for c in [*self.clients.values(), *([self.admin] if self.admin else [])]:
            with contextlib.suppress(Exception):
                c.close()
        self.clients.clear()
        clean = self.daemon is None or self.daemon.stop()
        self.proxy.stop()
        with contextlib.suppress(Exception):  # the schedule's objects leave the bucket (a shared one, in the suite)
            delete_prefix({"endpoint": self.s3.endpoint, "bucket": self.s3.bucket, "access_key": self.s3.access_key,
                           "secret_key": self.s3.secret_key}, self.prefix + "/")
        if self.tmpfs:
            sh("chattr", "-R", "-f", "-i", str(self.disk))
            sh("umount", "-l", str(self.disk))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return clean

    # -- clients --------------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self.daemon is not None
        return str(self.daemon.info.get("endpoint") or ipc_endpoint(self.tmp, "d.sock"))

    def token_of(self, tenant: str) -> str:
        return (self.tmp / f"{tenant}.token").read_text().strip()

    def client(self, tenant: str, session: int) -> WorkerClient:
        """The tenant's session client, registered (again, if the daemon dropped it)."""
        c = self.clients.get((tenant, session))
        if c is None or not c.token:
            c = c or WorkerClient(self.endpoint, timeout_s=4.0, tenant_token=self.token_of(tenant))
            self.clients[(tenant, session)] = c
            c.register(layout_of(tenant), worker_id=f"{tenant}{session}", engine_id=f"{tenant}-e{session}")
        return c

    def drop_client(self, tenant: str, session: int) -> None:
        c = self.clients.pop((tenant, session), None)
        if c is not None:
            c.close()

    def admin_client(self) -> WorkerClient:
        if self.admin is None or not self.admin.token:
            token = (self.tmp / "admin.token").read_text().strip()
            self.admin = self.admin or WorkerClient(self.endpoint, timeout_s=4.0, admin_token=token)
            self.admin.register(layout_of("c"), worker_id="admin", engine_id="admin")
        return self.admin

    def keys(self, tenant: str, idx: list[int]) -> list[BlockKey]:
        ns = layout_of(tenant).namespace
        return [BlockKey(ns, block_hash(self.seed, tenant, i)) for i in idx]

    def content(self, k: BlockKey) -> bytes:
        return content(k.namespace, k.hash, self.seed, self.nbytes)

    # -- the bucket -------------------------------------------------------------------------------------------
    def in_bucket(self, ks: list[BlockKey]) -> dict[BlockKey, bytes | Unreadable | None]:
        """Each block as a fresh S3 client reads it straight from SeaweedFS (no proxy, no daemon): its bytes, None
        when the bucket answers that it lacks it (404), :data:`UNREADABLE` when the bucket could not be asked (a
        failed GET and HEAD: a loaded SeaweedFS, not a lost block)."""

        async def go() -> dict[BlockKey, bytes | Unreadable | None]:
            cfg = S3Config(bucket=self.s3.bucket, prefix=self.prefix, max_retries=2, breaker_failures=1000)
            t = make_s3_tier(cfg, self.s3.endpoint, (self.s3.access_key, self.s3.secret_key))
            try:
                await t.start()
            except TierUnavailableError:
                return dict.fromkeys(ks, UNREADABLE)
            try:
                out: dict[BlockKey, bytes | Unreadable | None] = {}
                for k in ks:
                    buf = bytearray(self.nbytes)
                    n = await t.get_into(k, memoryview(buf))
                    if n is not None:
                        out[k] = bytes(buf[:n])
                        continue
                    try:  # a miss or a failed GET: the bucket's word on whether it is there
                        found = await t.exists_many([k])
                    except TierUnavailableError:
                        found = {}
                    out[k] = None if k in found and found[k] is None else UNREADABLE
                return out
            finally:
                await t.close()

        return asyncio.run(go()) if ks else {}

    def evidence(self, keys: list[BlockKey]) -> str:
        """What the daemon knows of ``keys`` (an acked block found lost): its owed-write counters, the bucket
        index's state, the journal lines and the log lines naming them; for a one-off campaign finding."""
        parts: list[str] = []
        with contextlib.suppress(Exception):
            st = self.admin_client().stats()
            m, d = st.get("manager", {}), st.get("daemon", {})
            parts.append("manager: " + ", ".join(f"{k}={m.get(k)}" for k in (
                "owed", "owed_resumed", "owed_reconciled", "owed_paid", "owed_dropped", "catch_up_writes",
                "cascade_failures", "errors") if k in m))
            parts.append("daemon: " + ", ".join(f"{k}={d.get(k)}" for k in (
                "bucket_indexed", "bucket_index_error", "bucket_pending") if k in d))
        hexes = [k.hash.hex() for k in keys]
        with contextlib.suppress(OSError):
            lines = (self.disk / JOURNAL).read_text(errors="replace").splitlines()
            parts.append("journal: " + " | ".join(ln for ln in lines if any(h in ln for h in hexes))[-800:])
        if self.daemon is not None:
            with contextlib.suppress(OSError):
                log = self.daemon.log_path.read_text(errors="replace").splitlines()
                keep = [ln for ln in log if any(h in ln or h[:16] in ln for h in hexes)
                        or any(w in ln for w in ("owed", "reconcil", "bucket.index", "daemon.started"))]
                parts.append("log: " + "\n".join(keep)[-2500:])
        return "\n".join(parts)


class Unreadable:
    """A block the bucket could not be asked about (see :meth:`World.in_bucket`)."""

    def __repr__(self) -> str:
        return "UNREADABLE"


UNREADABLE = Unreadable()
