"""Prometheus text exposition of the daemon's counters, served by a tiny asyncio HTTP server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _fmt(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seen: set[str] = set()

    def add(self, name: str, kind: str, help_: str, value: float, **labels: str) -> None:
        if name not in self._seen:
            self._seen.add(name)
            self.lines.append(f"# HELP {name} {help_}")
            self.lines.append(f"# TYPE {name} {kind}")
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        self.lines.append(f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}")


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(snapshot: dict[str, Any]) -> str:
    """Prometheus text for a daemon stats snapshot (``Daemon.snapshot()``)."""
    w = _Writer()
    for t in snapshot.get("tiers", []):
        name, st = str(t.get("tier")), t.get("stats", {})
        w.add("kvbm_tier_blocks", "gauge", "Blocks held per tier.", t.get("blocks", 0), tier=name)
        w.add("kvbm_tier_used_bytes", "gauge", "Bytes used per tier.", t.get("used_bytes", 0), tier=name)
        w.add("kvbm_tier_capacity_bytes", "gauge", "Capacity per tier.", t.get("capacity_bytes", 0), tier=name)
        for key, help_ in (
            ("hits", "Tier reads that found the block."),
            ("misses", "Tier reads that did not."),
            ("corrupt", "Blocks that failed their checksum (served as misses)."),
            ("errors", "Backend errors (e.g. S3 requests that failed)."),
            ("bytes_in", "Bytes written into the tier."),
            ("bytes_out", "Bytes read from the tier."),
        ):
            w.add(f"kvbm_tier_{key}_total", "counter", help_, st.get(key, 0), tier=name)
    m = snapshot.get("manager", {})
    for key, help_ in (
        ("lookups", "Lookups."),
        ("lookup_blocks", "Blocks asked for by lookups."),
        ("lookup_hit_blocks", "Blocks found by lookups."),
        ("onboards", "Onboards."),
        ("onboard_blocks", "Blocks onboarded."),
        ("onboard_seconds", "Seconds spent onboarding."),
        ("offloads", "Offload requests."),
        ("offload_blocks", "Blocks offloaded."),
        ("evictions", "Evictions."),
        ("shed_offloads", "Write-through cascades shed by the manager."),
        ("cascade_failures", "Write-through copies that failed."),
    ):
        w.add(f"kvbm_manager_{key}_total", "counter", help_, m.get(key, 0))
    w.add("kvbm_lookup_misses_total", "counter", "Blocks asked for by lookups and not found.",
          m.get("lookup_blocks", 0) - m.get("lookup_hit_blocks", 0))
    w.add("kvbm_pending_cascades", "gauge", "Write-through copies in flight.", m.get("pending_cascades", 0))
    d = snapshot.get("daemon", {})
    for key, kind, help_ in (
        ("requests", "counter", "Requests received."),
        ("shed", "counter", "PrepareStore requests shed under load."),
        ("dropped", "counter", "Frames dropped without a reply."),
        ("offload_seconds", "counter", "Seconds spent in PrepareStore/CommitStore."),
        ("onboard_seconds", "counter", "Seconds spent in Onboard."),
        ("lookup_seconds", "counter", "Seconds spent in Lookup."),
        ("events_published", "counter", "Block event batches published."),
        ("expired_workers", "counter", "Workers whose lease ran out."),
        ("queue_depth", "gauge", "Offload requests in flight."),
        ("inflight", "gauge", "Requests in flight."),
        ("workers", "gauge", "Registered workers."),
        ("pins", "gauge", "Blocks pinned for workers."),
    ):
        suffix = "_total" if kind == "counter" else ""
        w.add(f"kvbm_daemon_{key}{suffix}", kind, help_, d.get(key, 0))
    for code, n in sorted(d.get("errors", {}).items()):
        w.add("kvbm_daemon_errors_total", "counter", "Error replies by code.", n, code=code)
    for engine, v in sorted(snapshot.get("engines", {}).items()):
        for medium, n in sorted(v.get("blocks", {}).items()):
            w.add("kvbm_engine_blocks", "gauge", "Blocks an engine reports resident.", n, engine=engine, medium=medium)
        for key in ("events", "gaps", "replayed", "unfilled"):
            w.add(f"kvbm_engine_{key}_total", "counter", f"vLLM KV events: {key}.", v.get(key, 0), engine=engine)
    return "\n".join(w.lines) + "\n"


class MetricsServer:
    """Serves ``GET /metrics`` with ``render(snapshot())``; anything else is 404."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str = "127.0.0.1", port: int = 0) -> None:
        self.snapshot = snapshot
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] in ("/metrics", "/"):
                body, status = render(self.snapshot()).encode(), "200 OK"
            else:
                body, status = b"not found\n", "404 Not Found"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError) as e:
            log.debug("metrics request failed: %s", e)
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()
