"""Daemon link: a short-lived, registration-only client (no shared-memory mapping) for Stats, Evict,
Reindex and Onboard/Release. It registers with the admin token and CURVE client keys of the config
(:meth:`DaemonLink.for_config`), so the daemon lets it evict and onboard any namespace.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any

from kvbm.config import Config


def daemon_reachable(endpoint: str, timeout_s: float = 0.3) -> tuple[bool, str]:
    """A cheap pre-check before a ZeroMQ round trip: is anything listening at ``endpoint``?"""
    if endpoint.startswith("tcp://"):
        hostport = endpoint[len("tcp://") :]
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]")
        if host in ("*", "0.0.0.0", ""):
            host = "127.0.0.1"
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True, ""
        except ValueError:
            return False, f"bad daemon endpoint {endpoint!r}"
        except OSError as e:
            return False, f"nothing listens at {endpoint} ({e.strerror or type(e).__name__})"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path.startswith("@"):
            return True, ""
        if not os.path.exists(path):
            return False, f"no daemon socket at {path}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a killed daemon leaves its socket file
            s.settimeout(timeout_s)
            try:
                s.connect(path)
            except OSError as e:
                return False, f"nothing listens at {endpoint} ({e.strerror or type(e).__name__})"
        return True, ""
    if "://" not in endpoint:
        return False, f"bad daemon endpoint {endpoint!r} (e.g. tcp://127.0.0.1:5557 or ipc:///run/kvbm.sock)"
    return True, ""


class DaemonLink:
    """A registration-only session with the daemon (every request but Register needs a worker token).

    It registers a 1-byte dummy layout and never maps the daemon's shared memory; :meth:`close`
    unregisters, so the daemon's worker count drops back."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0, curve_server_key: str = "", *,
                 curve_keypair: tuple[bytes, bytes] | None = None, admin_token: str = "",
                 tenant_token: str = "") -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve_server_key = curve_server_key
        self.curve_keypair = curve_keypair
        self.admin_token = admin_token
        self.tenant_token = tenant_token  # used only without the admin token (which wins)
        self.client: Any = None
        self.registered: Any = None

    @classmethod
    def for_config(cls, cfg: Config, endpoint: str, timeout_s: float = 2.0) -> DaemonLink:
        """A link with the config's CURVE client keys and, when readable, its admin token."""
        from kvbm.client import client_options

        return cls(endpoint, timeout_s, **client_options(cfg.daemon, admin=True))

    @property
    def admin(self) -> bool:
        return bool(self.admin_token)

    def open(self) -> DaemonLink:
        from kvbm import protocol as p
        from kvbm.blocks.layout import KVLayout
        from kvbm.client import WorkerClient

        layout = KVLayout(model="kvbm-cli", num_layers=1, num_kv_heads=1, head_size=1, dtype="uint8", kv_factor=1,
                          tokens_per_block=1, block_bytes=1)
        self.client = WorkerClient(self.endpoint, timeout_s=self.timeout_s, curve_server_key=self.curve_server_key,
                                   curve_keypair=self.curve_keypair, admin_token=self.admin_token)
        try:
            reg = self.client.request(p.Register(worker_id=f"kvbm-cli-{os.getpid()}-{secrets.token_hex(3)}",
                                                 engine_id="kvbm-cli", layout=layout, admin_token=self.admin_token,
                                                 tenant_token="" if self.admin_token else self.tenant_token),
                                      p.Registered)
        except BaseException:
            self.client._reset()
            self.client = None
            raise
        self.client.token = reg.token
        self.client.generation = reg.generation  # its Onboard/Release name slots of this pool generation
        self.registered = reg
        return self

    def stats(self) -> dict[str, Any]:
        return self.client.stats()  # type: ignore[no-any-return]

    def tiers(self) -> list[str]:
        return [t.get("tier", "") for t in self.stats().get("tiers", [])]

    def evict(self, namespace: str, hashes: Sequence[bytes], tiers: list[str] | None,
              chunk: int = 8192, timeout_s: float = 60.0, *, gone: bool = False) -> tuple[int, int]:
        """Evict ``hashes`` of ``namespace`` from ``tiers`` (``gone``: already deleted there, drop the index
        entries only); returns (removed, skipped as pinned)."""
        from kvbm import protocol as p

        removed = skipped = 0
        for i in range(0, len(hashes), chunk):
            msg = p.Evict(namespace=namespace, hashes=list(hashes[i : i + chunk]), tiers=tiers, gone=gone)
            rep = self.client.request(msg, p.Evicted, timeout_s)
            removed += rep.removed
            skipped += rep.skipped
        return removed, skipped

    def reindex(self, namespace: str, tiers: list[str] | None, timeout_s: float = 120.0) -> int:
        """Have the daemon re-read ``tiers`` for ``namespace``; returns the blocks it did not know before."""
        from kvbm import protocol as p

        return int(self.client.request(p.Reindex(namespace=namespace, tiers=tiers), p.Reindexed, timeout_s).added)

    def onboard(self, namespace: str, hashes: Sequence[bytes], timeout_s: float = 120.0) -> tuple[int, int]:
        """Onboard the leading held run of ``hashes`` into the daemon's host tier and release the pins at
        once (the blocks stay cached there); returns (leading blocks onboarded, their bytes)."""
        from kvbm import protocol as p

        rep = self.client.request(p.Onboard(namespace=namespace, hashes=list(hashes)), p.Onboarded, timeout_s)
        if rep.count:
            self.client.request(p.Release(namespace=namespace, hashes=list(hashes[: rep.count])), p.Released)
        return int(rep.count), int(sum(rep.nbytes))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def __enter__(self) -> DaemonLink:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
