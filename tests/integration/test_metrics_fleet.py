"""The fleet's probe and peer counters on the Prometheus page: two daemon subprocesses sharing one real
SeaweedFS bucket, the second following the first's events and probing the bucket on lookup misses."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import ServeProc, wait_until

from kvbm.bench.openai_server import free_port as _free_port
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout

LAYOUT = KVLayout(model="fleetm", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
NB = LAYOUT.block_nbytes


def free_port() -> int:
    return _free_port()  # not from the kernel's ephemeral range (kvbm.bench.openai_server)


def node(tmp: Path, srv: Any, prefix: str, **dc: Any) -> ServeProc:
    tmp.mkdir()
    return ServeProc(tmp, {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
               "secret_key": srv.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "metrics_port": -1, **dc},
    })


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {labels: value}} of the daemon's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_fleet_probe_and_peer_counters_are_exported_as_metrics(tmp_path, s3_server):
    prefix = f"fm-{os.urandom(4).hex()}"
    events = f"tcp://127.0.0.1:{free_port()}"
    a = node(tmp_path / "a", s3_server, prefix, events_endpoint=events).start()
    b = node(tmp_path / "b", s3_server, prefix, events_endpoint="", peers=[events], probe_budget_ms=2000).start()
    try:
        wa, wb = a.client(), b.client()
        wa.register(LAYOUT, worker_id="wa")
        wb.register(LAYOUT, worker_id="wb")
        assert wait_until(lambda: wb.stats()["daemon"]["fleet"]["peers"][0]["connected"], timeout=30)
        # A stores two blocks durably (to the bucket): B learns them from A's events.
        stored = [BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(2)]
        ack = wa.store(stored, [np.full(NB, i + 1, np.uint8) for i in range(2)], durable=True)
        assert ack.durable == 2
        assert wait_until(lambda: wb.stats()["daemon"]["fleet"]["peers"][0]["stored"] >= 2, timeout=30)
        # A lookup of blocks nobody stored misses on B: it probes the bucket, which lacks them.
        assert wb.lookup([BlockKey(LAYOUT.namespace, os.urandom(16)) for _ in range(3)]).matched == 0
        fleet = wait_until(lambda: (f := wb.stats()["daemon"]["fleet"])["probe"]["missed"] >= 1 and f, timeout=30)
        assert fleet, "the lookup's probe never finished"
        m = scrape(b.info["metrics_port"])
        probe, peer = fleet["probe"], fleet["peers"][0]
        assert m["kvbm_fleet_probes_total"][()] == probe["probes"] >= 1
        assert m["kvbm_fleet_probe_blocks_total"][()] == probe["probed"] >= 1
        assert m["kvbm_fleet_probe_hits_total"][()] == probe["found"]
        assert m["kvbm_fleet_probe_misses_total"][()] == probe["missed"] >= 1
        assert m["kvbm_fleet_probe_negative_cache"][()] == probe["negative_cache"] >= 1
        assert m["kvbm_fleet_peers"][()] == 1 and m["kvbm_fleet_peers_connected"][()] == 1
        lbl = (("peer", events),)
        assert m["kvbm_fleet_peer_connected"][lbl] == 1
        assert m["kvbm_fleet_peer_stored_total"][lbl] == peer["stored"] >= 2
        assert m["kvbm_fleet_peer_gaps_total"][lbl] == peer["gaps"]
        assert m["kvbm_fleet_peer_resets_total"][lbl] == peer["resets"]
        # A's page has no peers and a probe that never ran, and says so.
        ma = scrape(a.info["metrics_port"])
        assert ma["kvbm_fleet_peers"][()] == 0 and ma["kvbm_fleet_probes_total"][()] == 0
        wa.close()
        wb.close()
    finally:
        b.stop()
        a.stop()
