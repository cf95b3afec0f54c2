"""The daemon's Prometheus metrics (``prometheus-client``) and the HTTP server for /metrics, /healthz, /readyz.

Each :class:`Metrics` has its own ``CollectorRegistry`` (never the global one), so several daemons in one
process do not collide. Latency histograms are observed at the call sites: the daemon's request handlers
(lookup, onboard, store), the manager's block copies between tiers (``BlockManager.observe_copy``: offload
per destination tier, onboard per source tier) and the S3 tier's requests (``S3Tier.observe``); both hooks
default to :func:`no_observe`. Counters and gauges are read from the daemon's stats snapshot at scrape time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvbm.errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# 10 us (an in-memory lookup) .. 60 s (a large onboard from a slow bucket).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)




Snapshot = Callable[[], dict[str, Any]]
Readiness = Callable[[], dict[str, Any]]

_TIER_HELP = {
    "hits": "Tier reads that found the block.",
    "misses": "Tier reads that did not.",
    "corrupt": "Blocks that failed their checksum (served as misses).",
    "errors": "Backend errors (e.g. S3 requests that failed).",
    "bytes_in": "Bytes written into the tier.",
    "bytes_out": "Bytes read from the tier.",
    "shed": "Writes shed (e.g. S3 circuit breaker open or too many pending writes).",
    "short_reads": "Reads refused: the block held another length than indexed (never served).",
    "reconfirms": "Shared-tier blocks HEADed again before a durable store or a disk eviction relied on them.",
    "stale": "Of them, blocks another node had deleted: forgotten.",
}
_MANAGER = (
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
    ("catch_up_writes", "Write-throughs retried after their tier took writes again (e.g. S3 back)."),
    ("owed_paid", "Owed write-throughs that reached their tier."),
    ("owed_dropped", "Write-throughs not owed because s3.max_owed_blocks were owed already."),
    ("owed_resumed", "Owed write-throughs resumed from the journal at start."),
    ("owed_reconciled", "Blocks on disk the bucket lacked at its first listing, owed to it."),
    ("demotion_failures", "Demotions of eviction victims that failed."),
    ("kept", "Evictions refused: a persistent tier's block that no lower tier could really take."),
    ("dropped", "Memory-tier blocks evicted although no lower tier could take them (e.g. S3 down)."),
    ("partial_evictions", "Evictions of partial blocks (those never hit are evicted first)."),
    ("partials_superseded", "Partial blocks dropped from every tier once their full block was stored."),
    ("partials_kept", "Superseded partial blocks left in place because a worker was reading them."),
)
_DAEMON = (
    ("requests", "counter", "Requests received."),
    ("shed", "counter", "PrepareStore requests shed under load."),
    ("dropped", "counter", "Frames dropped without a reply."),
    ("offload_seconds", "counter", "Seconds spent in PrepareStore/CommitStore."),
    ("onboard_seconds", "counter", "Seconds spent in Onboard."),
    ("lookup_seconds", "counter", "Seconds spent in Lookup."),
    ("events_published", "counter", "Block event batches published."),
    ("expired_workers", "counter", "Workers whose lease ran out."),
    ("prefetches", "counter", "Background prefetches to G2 started by lookups."),
    ("queue_depth", "gauge", "Offload requests in flight."),
    ("inflight", "gauge", "Requests in flight."),
    ("workers", "gauge", "Registered workers."),
    ("pins", "gauge", "Blocks pinned for workers."),
    ("quarantined_slots", "gauge", "G2 slots of expired workers held until they finish or their grace ends."),
    ("refused_workers", "counter", "Registrations refused because daemon.max_workers were registered."),
    ("client_limited", "counter", "Requests refused `busy`: their client had its cap in flight."),
    ("deferred", "counter", "Requests whose start waited a turn or more behind their client's others."),
)
# The fleet (kvbm.fleet): the bucket probe's counters (ProbeStats key, metric name, help) and each peer's.
_PROBE = (
    ("probes", "kvbm_fleet_probes", "Bucket probes started by lookups that missed."),
    ("joined", "kvbm_fleet_probe_joined", "Lookups that joined a probe already in flight."),
    ("probed", "kvbm_fleet_probe_blocks", "Blocks probed (one HEAD each)."),
    ("found", "kvbm_fleet_probe_hits", "Probed blocks the bucket held (now indexed)."),
    ("missed", "kvbm_fleet_probe_misses", "Probed blocks the bucket lacked (now negative-cached)."),
    ("negative_hits", "kvbm_fleet_probe_negative_hits", "Lookups whose next block was known missing: no HEAD."),
    ("failed", "kvbm_fleet_probe_failed", "Probes that could not ask (S3 unreachable, breaker open)."),
    ("late", "kvbm_fleet_probe_late", "Lookups answered before their probe finished."),
)
_PEER = (
    ("connects", "Times the connection to the peer (re)started."),
    ("batches", "Event batches received from the peer."),
    ("stored", "Shared-tier blocks learned from the peer's events."),
    ("removed", "Shared-tier blocks dropped because of the peer's events."),
    ("gaps", "Jumps in the peer's sequence numbers (messages lost)."),
    ("lost", "Batches lost in those jumps."),
    ("resets", "Sequence numbers that started again (the peer restarted)."),
    ("bad", "Messages from the peer that did not decode."),
)


def breaker_state(tier: dict[str, Any]) -> str | None:
    """The S3 tier's circuit-breaker state from its describe(): a string, or ``{"state": ...}``."""
    b = tier.get("breaker")
    if isinstance(b, dict):
        b = b.get("state")
    return None if b is None else str(b)


class _SnapshotCollector:
    """Counters and gauges of one stats snapshot, taken at scrape time."""

    def __init__(self, snapshot: Snapshot, readiness: Readiness) -> None:
        self.snapshot = snapshot
        self.readiness = readiness

    def collect(self) -> list[Metric]:
        ready = self.readiness()
        out: list[Metric] = []
        g = GaugeMetricFamily("kvbm_ready", "1 when /readyz answers 200 (serving, bucket indexed, S3 reachable).")
        g.add_metric([], 1.0 if ready.get("ready") else 0.0)
        out.append(g)
        if not ready.get("checks", {}).get("serving"):
            return out  # not serving yet: the tiers are not all started
        snap = self.snapshot()
        out += self._tiers(snap.get("tiers", []))
        m = snap.get("manager", {}) or {}
        for key, help_ in _MANAGER:
            out.append(CounterMetricFamily(f"kvbm_manager_{key}", help_, value=m.get(key, 0)))
        bg = CounterMetricFamily("kvbm_manager_background_errors", "Background cascade/demotion failures, by "
                                 "destination tier and exception type.", labels=["tier", "type"])
        for kind, n in sorted((m.get("errors") or {}).items()):
            tier, _, typ = str(kind).partition(":")
            bg.add_metric([tier, typ], n)
        out.append(bg)
        owed = GaugeMetricFamily("kvbm_manager_owed_writes", "Write-throughs waiting for their tier to take "
                                 "writes again (S3 down or shedding).", labels=["tier"])
        for tier, n in sorted((m.get("owed") or {}).items()):
            owed.add_metric([tier], n)
        out.append(owed)
        out.append(CounterMetricFamily("kvbm_lookup_misses", "Blocks asked for by lookups and not found.",
                                       value=m.get("lookup_blocks", 0) - m.get("lookup_hit_blocks", 0)))
        out.append(GaugeMetricFamily("kvbm_pending_cascades", "Write-through copies in flight.",
                                     value=m.get("pending_cascades", 0)))
        d = snap.get("daemon", {}) or {}
        for key, kind, help_ in _DAEMON:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            out.append(cls(f"kvbm_daemon_{key}", help_, value=d.get(key, 0)))
        out.append(GaugeMetricFamily("kvbm_bucket_indexed", "1 once the bucket has been listed.",
                                     value=1.0 if d.get("bucket_indexed") else 0.0))
        errs = CounterMetricFamily("kvbm_daemon_errors", "Error replies by code.", labels=["code"])
        for code, n in sorted((d.get("errors") or {}).items()):
            errs.add_metric([code], n)
        out.append(errs)
        out += self._fleet(d.get("fleet") or {})
        out += self._engines(snap.get("engines", {}) or {})
        return out

    @staticmethod
    def _fleet(fleet: dict[str, Any]) -> list[Metric]:
        probe = fleet.get("probe") or {}  # None: no shared tier, or probes off
        out: list[Metric] = [CounterMetricFamily(name, help_, value=probe.get(key, 0)) for key, name, help_ in _PROBE]
        out.append(GaugeMetricFamily("kvbm_fleet_probe_negative_cache", "Blocks known missing from the bucket (not "
                                     "probed again until their entry expires).", value=probe.get("negative_cache", 0)))
        out.append(GaugeMetricFamily("kvbm_fleet_probe_in_flight", "Blocks being probed.",
                                     value=probe.get("in_flight", 0)))
        peers = fleet.get("peers") or []
        out.append(GaugeMetricFamily("kvbm_fleet_peers", "Peers followed (daemon.peers).", value=len(peers)))
        out.append(GaugeMetricFamily("kvbm_fleet_peers_connected", "Peers whose event stream is connected.",
                                     value=sum(1 for peer in peers if peer.get("connected"))))
        connected = GaugeMetricFamily("kvbm_fleet_peer_connected", "1 while the peer's event stream is connected.",
                                      labels=["peer"])
        counters = {k: CounterMetricFamily(f"kvbm_fleet_peer_{k}", h, labels=["peer"]) for k, h in _PEER}
        for peer in peers:
            ep = str(peer.get("endpoint", ""))
            connected.add_metric([ep], 1.0 if peer.get("connected") else 0.0)
            for k, fam in counters.items():
                fam.add_metric([ep], peer.get(k, 0))
        return [*out, connected, *counters.values()]

    @staticmethod
    def _tiers(tiers: list[dict[str, Any]]) -> list[Metric]:
        fams: dict[str, Metric] = {
            "blocks": GaugeMetricFamily("kvbm_tier_blocks", "Blocks held per tier.", labels=["tier"]),
            "used_bytes": GaugeMetricFamily("kvbm_tier_used_bytes", "Bytes used per tier.", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily("kvbm_tier_capacity_bytes", "Capacity per tier.", labels=["tier"]),
        }
        breaker = GaugeMetricFamily("kvbm_s3_breaker_open", "1 while the S3 circuit breaker is open.",
                                    labels=["tier"])
        opens = CounterMetricFamily("kvbm_s3_breaker_opens", "Times the S3 circuit breaker opened.", labels=["tier"])
        online = GaugeMetricFamily("kvbm_s3_online", "1 once the S3 endpoint answered (0: started during an "
                                   "outage and not reached yet).", labels=["tier"])
        counters: dict[str, CounterMetricFamily] = {}
        for t in tiers:
            name = str(t.get("tier"))
            for key in ("blocks", "used_bytes", "capacity_bytes"):
                fams[key].add_metric([name], t.get(key) or 0)
            for key, v in sorted((t.get("stats") or {}).items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    if key not in counters:
                        counters[key] = CounterMetricFamily(f"kvbm_tier_{key}", _TIER_HELP.get(key, f"Tier {key}."),
                                                            labels=["tier"])
                    counters[key].add_metric([name], v)
            if t.get("kind") == "s3":
                breaker.add_metric([name], 1.0 if breaker_state(t) == "open" else 0.0)
                b = t.get("breaker")
                opens.add_metric([name], b.get("opens", 0) if isinstance(b, dict) else 0)
                online.add_metric([name], 0.0 if t.get("online") is False else 1.0)
        return [*fams.values(), *counters.values(), breaker, opens, online]

    @staticmethod
    def _engines(engines: dict[str, Any]) -> list[Metric]:
        blocks = GaugeMetricFamily("kvbm_engine_blocks", "Blocks an engine reports resident.",
                                   labels=["engine", "medium"])
        counters = {k: CounterMetricFamily(f"kvbm_engine_{k}", f"vLLM KV events: {k}.", labels=["engine"])
                    for k in ("events", "gaps", "replayed", "unfilled")}
        for engine, v in sorted(engines.items()):
            for medium, n in sorted((v.get("blocks") or {}).items()):
                blocks.add_metric([engine, medium], n)
            for k, fam in counters.items():
                fam.add_metric([engine], v.get(k, 0))
        return [blocks, *counters.values()]


class Metrics:
    """One daemon's registry: latency histograms, the snapshot's counters and gauges, process metrics."""

    def __init__(self, snapshot: Snapshot, readiness: Readiness | None = None,
                 tiers: Sequence[str] = ("G1", "G2", "G3", "G4")) -> None:
        self.registry = CollectorRegistry()
        self.order = {name: i for i, name in enumerate(tiers)}
        h = {"registry": self.registry, "buckets": LATENCY_BUCKETS}
        self.lookup = Histogram("kvbm_lookup_seconds", "Lookup requests, by the slowest tier of the matched run "
                                "(none: no match).", ["tier"], **h)
        self.onboard = Histogram("kvbm_onboard_seconds", "Onboard requests (to G2), by the slowest tier the run "
                                 "came from (none: no match).", ["tier"], **h)
        self.onboard_block = Histogram("kvbm_onboard_block_seconds", "One block copied up from a tier.",
                                       ["tier"], **h)
        self.offload = Histogram("kvbm_offload_seconds", "One block written down into a tier (write-through).",
                                 ["tier"], **h)
        self.store = Histogram("kvbm_store_seconds", "PrepareStore / CommitStore requests (commit_durable waits "
                               "for disk or S3).", ["op"], **h)
        self.s3_request = Histogram("kvbm_s3_request_seconds", "S3 requests that succeeded, by operation.",
                                    ["op"], **h)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.readiness = readiness or (lambda: {"ready": True, "checks": {"serving": True}})
        self.registry.register(_SnapshotCollector(snapshot, self.readiness))

    def slowest(self, tiers: Sequence[str]) -> str:
        """The slowest of ``tiers`` (the one a request's latency comes from), or ``none``."""
        return max(tiers, key=lambda t: self.order.get(t, -1)) if tiers else "none"

    def observe_copy(self, src: str, dst: str, seconds: float) -> None:
        """The manager's hook: a block copy from tier ``src`` to ``dst`` took ``seconds``."""
        if self.order.get(dst, 0) > self.order.get(src, 0):
            self.offload.labels(tier=dst).observe(seconds)
        else:
            self.onboard_block.labels(tier=src).observe(seconds)

    def observe_s3(self, op: str, seconds: float) -> None:
        """The S3 tier's hook: one request (``put``, ``get``) took ``seconds``."""
        self.s3_request.labels(op=op).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text page."""
        return generate_latest(self.registry)


class MetricsServer:
    """``GET /metrics`` (Prometheus text), ``/healthz`` (200 while the process serves HTTP) and ``/readyz``
    (200 when ready, else 503; a JSON body with the checks). Runs on the daemon's event loop, because the
    snapshot reads the daemon's state; a scrape costs well under a millisecond."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None

    async def bind(self) -> int:
        """Listen (not serving yet: :meth:`start`); the port, or ConfigError naming ``daemon.metrics_port`` when it
        cannot be had (a second daemon on one host, say)."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, start_serving=False)
        except OSError as e:
            raise ConfigError(f"daemon.metrics_port: cannot listen on {self.host}:{self.port} ({e.strerror or e}); "
                              f"another process holds it (a second daemon?): give this one another port, -1 for a "
                              f"free one, or 0 to disable metrics") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start(self) -> int:
        if self._server is None:
            await self.bind()
        assert self._server is not None
        await self._server.start_serving()
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _route(self, path: str) -> tuple[str, str, bytes]:
        if path in ("/metrics", "/"):
            return "200 OK", CONTENT_TYPE, self.metrics.render()
        if path == "/healthz":
            return "200 OK", "text/plain; charset=utf-8", b"ok\n"
        if path == "/readyz":
            rep = self.metrics.readiness()
            status = "200 OK" if rep.get("ready") else "503 Service Unavailable"
            return status, "application/json", json.dumps(rep).encode() + b"\n"
        return "404 Not Found", "text/plain; charset=utf-8", b"not found\n"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            head = bool(parts) and parts[0] == "HEAD"
            if len(parts) >= 2 and parts[0] in ("GET", "HEAD"):
                status, ctype, body = self._route(parts[1].split("?")[0])
            else:
                status, ctype, body = "405 Method Not Allowed", "text/plain; charset=utf-8", b"GET only\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (b"" if head else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError) as e:
            log.debug("metrics request failed: %s", e)
        except Exception:
            log.exception("metrics request failed")
        finally:
            writer.close()
