"""Worker sessions against a real daemon subprocess: the quarantine grace period of an expired lease
(``daemon.quarantine_grace_s``) and the cap on registrations (``daemon.max_workers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_proc import ServeProc, wait_until

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError
from kvbm.config import load_config
from kvbm.errors import ConfigError

SLOT = 64 * 1024
LAYOUT = KVLayout(model="sessions", num_layers=1, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes


def daemon(tmp: Path, **dc: Any) -> ServeProc:
    return ServeProc(tmp, {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": f"{8 * SLOT}", "pin": False},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": "", "metrics_port": 0, **dc},
    })


def keys(n: int, tag: bytes) -> list[BlockKey]:
    return [BlockKey(LAYOUT.namespace, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def g2_detached(st: dict[str, Any]) -> int:
    return next(t for t in st["tiers"] if t["tier"] == "G2")["detached_slots"]


def test_quarantined_slots_of_an_expired_worker_are_freed_after_the_configured_grace(tmp_path):
    # The default grace would be max(30 s, 2 x 1 s) = 30 s; 3 s is configured.
    d = daemon(tmp_path, worker_timeout_s=1.0, quarantine_grace_s=3.0).start()
    try:
        slow, other = d.client(), d.client()
        slow.register(LAYOUT, worker_id="slow")
        mine = keys(3, b"slow")
        held = slow.request(p.PrepareStore(namespace=LAYOUT.namespace, hashes=[k.hash for k in mine], nbytes=NB),
                            p.Slots).slots
        assert len([s for s in held if s is not None]) == 3
        st = wait_until(lambda: (s := other.stats())["daemon"]["expired_workers"] >= 1 and s, timeout=30, step=0.1)
        assert st, "the silent worker's lease never expired"
        assert st["daemon"]["quarantined_slots"] == 3 and g2_detached(st) == 3  # it may still be copying
        # Nobody names its keys again: the grace period alone frees the slots (well before the 30 s default).
        st = wait_until(lambda: (s := other.stats())["daemon"]["quarantined_slots"] == 0 and s, timeout=20, step=0.1)
        assert st, "the quarantine outlived its 3 s grace period"
        assert g2_detached(st) == 0
        # All 8 slots can be handed out again.
        other.register(LAYOUT, worker_id="other")
        ks = keys(8, b"other")
        assert other.store(ks, [bytes([i]) * NB for i in range(8)]).stored == 8
        slow._forget()  # its token is gone; nothing to unregister
        other.close()
    finally:
        d.stop()


def test_quarantine_grace_and_max_workers_are_validated_by_name(tmp_path):
    for field, bad in (("quarantine_grace_s", -1), ("max_workers", 0)):
        f = tmp_path / f"{field}.yaml"
        f.write_text(f"daemon: {{{field}: {bad}}}\n")
        with pytest.raises(ConfigError, match=f"daemon.{field}"):
            load_config(f, environ={})
    cfg = load_config(None, environ={})
    assert cfg.daemon.quarantine_grace_s is None and cfg.daemon.max_workers == 1024  # None: max(30 s, 2 x lease)


def test_registrations_beyond_max_workers_are_refused_with_limit_until_a_place_frees(tmp_path):
    d = daemon(tmp_path, worker_timeout_s=5.0, max_workers=2).start()
    try:
        a, b, c = d.client(), d.client(), d.client()
        a.register(LAYOUT, worker_id="a")
        b.register(LAYOUT, worker_id="b")
        with pytest.raises(DaemonError) as ei:
            c.register(LAYOUT, worker_id="c")
        assert ei.value.code == p.E_LIMIT and "max_workers" in ei.value.message
        # Registering again under a worker id that holds a place replaces it: no new place needed.
        a2 = d.client()
        a2.register(LAYOUT, worker_id="a")
        # The admin (the CLI's `kvbm status`) still gets in to look.
        with d.client(admin=True) as admin:
            admin.register(LAYOUT, worker_id="admin")
            st = admin.stats()["daemon"]
            assert st["workers"] == 3 and st["refused_workers"] == 1 and st["errors"]["limit"] == 1
        b.close()  # an unregistered worker frees its place at once
        c.register(LAYOUT, worker_id="c")
        with pytest.raises(DaemonError) as ei:
            d.client().register(LAYOUT, worker_id="d")
        assert ei.value.code == p.E_LIMIT
        # Silent workers' leases expire and free their places.
        watcher = d.client()
        assert wait_until(lambda: watcher.stats()["daemon"]["expired_workers"] >= 2, timeout=60, step=0.2)
        e, f = d.client(), d.client()
        e.register(LAYOUT, worker_id="e")
        f.register(LAYOUT, worker_id="f")
        st = e.stats()["daemon"]
        assert st["workers"] == 2 and st["refused_workers"] == 2
        for w in (e, f):
            w.close()
        for w in (a, a2, c):
            w._forget()
    finally:
        d.stop()
