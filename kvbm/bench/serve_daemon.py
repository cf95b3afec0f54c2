"""The kvbm daemon of a serving bench (``kvbm bench serve``, ``kvbm bench trace-serve``): restartable with other
tier sizes or S3 client, admin evictions, quiet waits, and its tier counters sampled into a bandwidth timeline."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from pathlib import Path
from typing import Any

from kvbm.bench.common import DaemonProc, writes_settled
from kvbm.bench.openai_server import free_port


class BenchDaemon:
    """``kvbm serve`` on a fixed endpoint, restartable with other tier sizes or S3 client (vLLM's workers
    re-register with the new pool); admin evictions and quiet waits for the passes."""

    def __init__(self, root: Path, block_bytes: int, srv: dict[str, Any]) -> None:
        self.root, self.block_bytes, self.srv = root, block_bytes, srv
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.token_file = root / "admin.token"
        self.proc: DaemonProc | None = None
        self.config: dict[str, Any] = {}

    def start(self, *, g2: int, g3: int, s3_client: str = "http", s3: bool = True) -> None:
        """(Re)start with G2 and G3 of these sizes and G4 (``s3``) through ``s3_client``."""
        g4 = {"endpoint": self.srv["endpoint"], "access_key": self.srv["access_key"],
              "secret_key": self.srv["secret_key"], "bucket": self.srv["bucket"],
              "prefix": f"{self.srv['prefix']}/serve", "client": s3_client, "max_pending_writes": 4096} if s3 else {
              "enabled": False}
        self.config = {
            "block_bytes": self.block_bytes, "device": {"enabled": False}, "host": {"capacity": g2},
            "disk": {"dir": str(self.root / "g3"), "capacity": g3, "fsync": False},
            "s3": g4, "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": self.endpoint, "events_endpoint": self.events, "metrics_port": 0,
                       "admin_token_file": str(self.token_file)},
        }
        self.stop()
        self.proc = DaemonProc(self.root, self.config, name="serve")
        self.proc.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def stats(self) -> dict[str, Any]:
        from kvbm.client import WorkerClient

        with WorkerClient(self.endpoint, timeout_s=10) as c:
            return c.stats()

    def namespaces(self) -> list[str]:
        d = self.root / "g3"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def evict(self, tiers: list[str]) -> int:
        from kvbm.ops import DaemonLink
        from kvbm.security import read_admin_token

        removed = 0
        with DaemonLink(self.endpoint, 30, admin_token=read_admin_token(self.token_file)) as link:
            for ns in self.namespaces():
                removed += link.client.evict(namespace=ns, tiers=tiers).removed
        if "G3" not in tiers:  # G3 keeps the blocks: read them from the disk, not the page cache
            drop_page_cache(self.root / "g3")
        return removed

    def wait_quiet(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Stats once no write-through is pending (background PUTs would compete with a timed request)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if writes_settled(st):
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon still busy after {timeout_s:.0f}s")
            time.sleep(0.25)


def drop_page_cache(d: Path) -> None:
    for f in d.rglob("*.kvb"):
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tier_counters(st: dict[str, Any]) -> dict[str, Any]:
    """Cumulative byte counters: per tier written (bytes_in) and read (bytes_out), and the onboard into vLLM."""
    out: dict[str, Any] = {t["tier"]: {"in": t["stats"]["bytes_in"], "out": t["stats"]["bytes_out"],
                                       "hits": t["stats"]["hits"]} for t in st["tiers"]}
    out["onboard_blocks"] = st["manager"]["onboard_blocks"]
    out["offload_blocks"] = st["manager"]["offload_blocks"]
    return out


class Sampler:
    """The daemon's counters every ``every_s`` in a thread (the read/write bandwidth timeline)."""

    def __init__(self, daemon: BenchDaemon, every_s: float) -> None:
        self.daemon, self.every_s = daemon, every_s
        self.samples: list[dict[str, Any]] = []
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Sampler:
        self.t0 = time.time()
        self._task = asyncio.create_task(self._run())
        return self

    async def _sample(self) -> None:
        with contextlib.suppress(Exception):
            st = await asyncio.to_thread(self.daemon.stats)
            self.samples.append({"t": round(time.time() - self.t0, 3), **tier_counters(st)})

    async def _run(self) -> None:
        while not self._stop:
            await self._sample()
            await asyncio.sleep(self.every_s)

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task is not None:
            await self._task
        await self._sample()  # a run shorter than one interval still has a start and an end


def timeline(samples: list[dict[str, Any]], block_bytes: int) -> dict[str, list[float]]:
    """MB/s between consecutive samples: each tier's writes and reads, and the onboard into vLLM (G2->G1)."""
    out: dict[str, list[float]] = {"t": []}
    for a, b in itertools.pairwise(samples):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        out["t"].append(b["t"])
        for tier in ("G2", "G3", "G4"):
            if tier in a and tier in b:
                out.setdefault(f"{tier} write", []).append(round((b[tier]["in"] - a[tier]["in"]) / dt / 1e6, 1))
                out.setdefault(f"{tier} read", []).append(round((b[tier]["out"] - a[tier]["out"]) / dt / 1e6, 1))
        out.setdefault("onboard G2->G1", []).append(
            round((b["onboard_blocks"] - a["onboard_blocks"]) * block_bytes / dt / 1e6, 1))
        out.setdefault("offload G1->G2", []).append(
            round((b["offload_blocks"] - a["offload_blocks"]) * block_bytes / dt / 1e6, 1))
    return out

