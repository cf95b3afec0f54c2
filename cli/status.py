"""``kvbm status``: what a running daemon holds, or what the disk directory and the bucket hold."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import click

from kvbm.cli.common import CliState, config_option, daemon_options, find_daemon, one_line_errors, pass_state
from kvbm.config import Config
from kvbm.config.schema import human_bytes
from kvbm.daemon.metrics import breaker_state
from kvbm.ops import DaemonLink, Selector, iso, iter_bucket, iter_disk, open_bucket, summarize


# -- status -------------------------------------------------------------------------------------------------
async def storage_report(cfg: Config, disk: bool = True, bucket: bool = True) -> dict[str, Any]:
    """Per-namespace usage of the disk directory and the bucket (what ``status --direct`` prints)."""
    out: dict[str, Any] = {"mode": "direct"}
    if disk and cfg.disk.enabled:
        entries = await asyncio.to_thread(lambda: list(iter_disk(cfg.disk_dir)))
        out["disk"] = {"dir": str(cfg.disk_dir), "capacity_bytes": cfg.disk.capacity,
                       **_usage(summarize(entries))}
    if bucket and cfg.s3.enabled:
        tier = await open_bucket(cfg, start_embedded=False)  # an inspection command starts nothing
        if tier is None:
            from kvbm.s3server import embedded_dir

            out["bucket"] = {"embedded": embedded_dir(cfg.embedded_s3), "running": False}
            return out
        try:
            foreign = [0]
            entries = [e async for e in iter_bucket(tier, Selector(shard_chars=tier.shard_chars), foreign)]
            out["bucket"] = {"endpoint": tier.endpoint_name, "bucket": tier.bucket, "prefix": tier.prefix,
                             "reachable": True, **_usage(summarize(entries)), "foreign_objects": foreign[0]}
        finally:
            await tier.close()
    return out


def _usage(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def fmt(u: dict[str, Any]) -> dict[str, Any]:
        return {"objects": u["objects"], "bytes": u["bytes"], "oldest": iso(u["oldest"]), "newest": iso(u["newest"])}

    total = summary.pop("*")
    return {"namespaces": {ns: fmt(u) for ns, u in sorted(summary.items())}, "total": fmt(total)}


def daemon_report(link: DaemonLink) -> dict[str, Any]:
    stats = link.stats()
    tiers = []
    for t in stats.get("tiers", []):
        st = t.get("stats", {}) or {}
        looked = st.get("hits", 0) + st.get("misses", 0)
        row = {"tier": t.get("tier"), "kind": t.get("kind"), "capacity_bytes": t.get("capacity_bytes"),
               "used_bytes": t.get("used_bytes"), "blocks": t.get("blocks"),
               "hit_rate": round(st.get("hits", 0) / looked, 4) if looked else None, "errors": st.get("errors", 0)}
        if t.get("read_only"):
            row["read_only"] = t["read_only"]
        if t.get("kind") == "s3":
            row.update(endpoint=t.get("endpoint"), bucket=t.get("bucket"), breaker=breaker_state(t),
                       pending_writes=t.get("pending_writes"))
        tiers.append(row)
    d = dict(stats.get("daemon", {}) or {})
    mgr = stats.get("manager", {}) or {}
    s3 = next((t for t in tiers if t["kind"] == "s3"), None)
    return {
        "mode": "daemon", "endpoint": link.endpoint,
        "workers": max(0, int(d.get("workers", 0)) - 1),  # not counting this command's own registration
        "queue_depth": d.get("queue_depth", 0), "inflight": max(0, int(d.get("inflight", 0))),
        "pins": d.get("pins", 0), "requests": d.get("requests", 0), "shed": d.get("shed", 0),
        "pending_cascades": mgr.get("pending_cascades", 0), "hit_rate": mgr.get("hit_rate"),
        "tiers": tiers,
        "s3": None if s3 is None else {"endpoint": s3.get("endpoint"), "bucket": s3.get("bucket"),
                                       "breaker": s3.get("breaker"), "healthy": s3.get("breaker") == "closed",
                                       "errors": s3.get("errors")},
        "engines": stats.get("engines", {}),
        "fleet": _fleet(d.get("fleet")),
        "router_events": d.get("router_events"),  # the vLLM-format residency stream's counters (None: off)
    }


PEER_FIELDS = ("endpoint", "node_id", "connected", "connects", "batches", "stored", "removed", "gaps", "lost",
               "resets", "last_seq", "failures", "error")


def _fleet(f: dict[str, Any] | None) -> dict[str, Any] | None:
    """Peers followed and bucket-probe counters (None for a daemon without a shared tier or that predates them)."""
    if not f or not f.get("shared_tier"):
        return None
    probe = f.get("probe")
    return {
        "peers": [{k: pr.get(k) for k in PEER_FIELDS} for pr in f.get("peers") or []],
        "probe": None if probe is None else {k: probe.get(k) for k in (
            "probes", "probed", "found", "missed", "hit_rate", "negative_cache", "negative_hits", "late", "failed")},
        "discovery": f.get("discovery"),
        "p2p": f.get("p2p"),  # peer reads: this node's reads from peers and what it served them (None: off)
    }


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def _ns_table(part: dict[str, Any]) -> list[str]:
    rows = [["namespace", "blocks", "bytes", "oldest", "newest"]]
    for ns, u in [*part["namespaces"].items(), ("TOTAL", part["total"])]:
        rows.append([ns, str(u["objects"]), human_bytes(u["bytes"]), u["oldest"] or "-", u["newest"] or "-"])
    return ["  " + line for line in _table(rows, {1, 2})]


def render_storage(rep: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "disk" in rep:
        d = rep["disk"]
        lines.append(f"disk {d['dir']} (capacity {human_bytes(d['capacity_bytes'])})")
        lines += _ns_table(d)
    if "bucket" in rep and not rep["bucket"].get("reachable"):
        lines.append(f"bucket: the embedded SeaweedFS is not running ({rep['bucket']['embedded']}); "
                     "`kvbm serve` or `kvbm s3 start` starts it")
    elif "bucket" in rep:
        b = rep["bucket"]
        lines.append(f"bucket {b['bucket']} at {b['endpoint']}, prefix {b['prefix'] or '(none)'}/")
        lines += _ns_table(b)
        if b["foreign_objects"]:
            lines.append(f"  {b['foreign_objects']} other objects under the prefix are not kvbm blocks (ignored)")
    if not lines:
        lines.append("no disk or S3 tier is enabled in this config")
    if "daemon" in rep:  # first: what a user asking for the status most needs to know
        d = rep["daemon"]
        why = "not running (kvbm serve)" if not d["running"] else f"not answering ({d['reason']})"
        lines.insert(0, f"daemon: {why}")
    return lines


def render_daemon(rep: dict[str, Any]) -> list[str]:
    hr = rep["hit_rate"]
    lines = [f"daemon {rep['endpoint']}: {rep['workers']} workers, queue {rep['queue_depth']}, "
             f"in flight {rep['inflight']}, pins {rep['pins']}, pending write-throughs {rep['pending_cascades']}, "
             f"lookup hit rate {'-' if hr is None else f'{hr:.1%}'}"]
    rows = [["tier", "kind", "capacity", "used", "blocks", "hit rate", "errors"]]
    for t in rep["tiers"]:
        kind = f"{t['kind']} (read-only)" if t.get("read_only") else str(t["kind"])
        rows.append([str(t["tier"]), kind, human_bytes(t["capacity_bytes"] or 0),
                     human_bytes(t["used_bytes"] or 0), str(t["blocks"]),
                     "-" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}", str(t["errors"])])
    lines += ["  " + line for line in _table(rows, {2, 3, 4, 5, 6})]
    s3 = rep["s3"]
    if s3:
        state = "healthy" if s3["healthy"] else f"UNHEALTHY (circuit breaker {s3['breaker']})"
        lines.append(f"S3 {s3['bucket']} at {s3['endpoint']}: {state}, {s3['errors']} errors")
    lines += render_fleet(rep.get("fleet"))
    return lines


def render_fleet(f: dict[str, Any] | None) -> list[str]:
    if f is None:
        return []
    pr = f["probe"]
    if pr is None:
        probe = "bucket probes off"
    else:
        hr = pr["hit_rate"]
        probe = (f"bucket probes: {pr['probed']} blocks asked, {pr['found']} found "
                 f"(hit rate {'-' if hr is None else f'{hr:.1%}'}), negative cache {pr['negative_cache']} "
                 f"({pr['negative_hits']} lookups spared a HEAD), {pr['late']} answered before their probe")
    lines = [f"fleet: {len(f['peers'])} peers followed; {probe}"]
    disc = f.get("discovery")
    if disc:
        lines.append(f"  discovery: node {disc['node']} announced as {disc['events_endpoint']}; "
                     f"{len(disc['members'])} members ({', '.join(disc['members']) or 'none'}), "
                     f"{disc['joined']} joins, {disc['left']} leaves, {disc['failed']} failed bucket calls"
                     + (f", {disc['conflicts']} NODE ID CONFLICTS" if disc.get("conflicts") else ""))
        if disc.get("host_local"):
            lines.append(f"  discovery: WARNING: {disc['host_local']}: other hosts will not follow this daemon "
                         "(set daemon.announce_endpoint)")
        for node, why in sorted((disc.get("unreachable_members") or {}).items()):
            lines.append(f"  discovery: member {node} NOT FOLLOWED: {why}")
    if f["peers"]:
        rows = [["peer", "state", "batches", "stored", "removed", "gaps", "resets"]]
        for p in f["peers"]:
            name = f"{p['endpoint']} ({p['node_id']})" if p.get("node_id") else str(p["endpoint"])
            state = "connected" if p["connected"] else "FAILING" if p.get("error") else "DISCONNECTED"
            rows.append([name, state, str(p["batches"]), str(p["stored"]), str(p["removed"]), str(p["gaps"]),
                         str(p["resets"])])
        lines += ["  " + line for line in _table(rows, {2, 3, 4, 5, 6})]
        for p in f["peers"]:
            if p.get("error") and not p["connected"]:
                lines.append(f"  peer {p['endpoint']}: FOLLOW FAILING ({p.get('failures') or 0} handshakes): "
                             f"{p['error']}")
    return lines


def watch_daemon(link: DaemonLink, interval: float, count: int, as_json: bool) -> None:
    """Print the daemon's view every ``interval`` seconds (``count`` times, 0: until Ctrl-C) over one session."""
    tty = not as_json and sys.stdout.isatty()
    shown = 0
    try:
        while True:
            rep = daemon_report(link)
            if as_json:
                click.echo(json.dumps(rep, default=str))
            else:
                if tty:
                    click.clear()
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                click.echo("\n".join([f"{stamp} (every {interval:g}s, Ctrl-C to stop)", *render_daemon(rep), ""]))
            shown += 1
            if count and shown >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        link.close()


@click.command("status")
@config_option
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--watch", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="Refresh the daemon's view every SECONDS until Ctrl-C (with --json: one object per line).")
@click.option("--count", type=click.IntRange(min=0), default=0, help="With --watch: stop after COUNT views.")
@one_line_errors
@pass_state
def status(state: CliState, daemon_endpoint: str | None, direct: bool, daemon_timeout: float,
           as_json: bool, watch: float | None, count: int) -> None:
    """Show what the cache holds.

    With a running daemon (--daemon, $KVBM_DAEMON, or daemon.endpoint of the config) it prints the
    daemon's view: each tier's capacity, use, blocks and hit rate, connected workers, queues and the
    S3 tier's health. With --direct, or when no daemon answers (it says so first: "daemon: not running"), it
    inspects storage itself: the disk directory and the bucket, with blocks, bytes and the oldest/newest block
    per model namespace. It starts nothing: an embedded SeaweedFS that is not running is reported, not started.

    \b
    Examples:
      kvbm status                      # daemon if one answers, else storage
      kvbm status --direct --json      # storage, machine-readable
      KVBM_S3_ENDPOINT=https://s3.example.com KVBM_S3_BUCKET=kv kvbm status --direct
      kvbm status --watch 2            # the daemon's view, refreshed every 2 s

    Exits non-zero with a one-line reason when an explicitly named daemon does not answer, or when the
    bucket is unreachable, missing, or refuses the credentials.
    """
    cfg = state.config
    link, why = find_daemon(cfg, daemon_endpoint, direct, daemon_timeout)
    if watch is not None:
        if link is None:
            raise click.ClickException(f"--watch shows a running daemon's view; {why}")
        watch_daemon(link, watch, count, as_json)
        return
    if link is not None:
        try:
            rep = daemon_report(link)
        finally:
            link.close()
        lines = render_daemon(rep)
    else:
        rep = asyncio.run(storage_report(cfg))
        if why != "--direct":
            rep["daemon"] = {"running": not why.startswith("no daemon at"),
                             "endpoint": daemon_endpoint or cfg.daemon.endpoint, "reason": why}
        lines = render_storage(rep)
    if as_json:
        click.echo(json.dumps(rep, indent=2, default=str))
    else:
        click.echo("\n".join(lines))
    s3 = rep.get("s3") if rep["mode"] == "daemon" else None
    if s3 and not s3["healthy"]:
        raise click.ClickException(f"the daemon's S3 tier at {s3['endpoint']} is unhealthy "
                                   f"(circuit breaker {s3['breaker']})")
