"""One tenant's ``namespaces`` against another tenant's ``models`` (issue 37, D1): a namespace a tenant lists is
that tenant's alone. Every daemon is ``kvbm serve`` in a subprocess (tests/serve_proc.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from serve_proc import ServeProc

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError

SLOT = 64 * 1024


def layout(model: str) -> KVLayout:
    return KVLayout(model=model, num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)


def cfg(tmp: Path, tenants: list[dict]) -> dict:
    return {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "4MiB"},
        "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"metrics_port": 0, "endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": f"ipc://{tmp}/ev.sock",
                   "tenants": tenants},
    }


def test_a_config_whose_models_glob_reaches_another_tenants_namespace_is_refused(tmp_path: Path) -> None:
    """Tenant a lists the namespace of meta-llama/Llama-3-8B; tenant b's ``meta-llama/*`` would register that
    model and land in it. ``kvbm serve`` refuses the config, naming both tenants and the fields."""
    ns = layout("meta-llama/Llama-3-8B").namespace
    d = ServeProc(tmp_path, cfg(tmp_path, [
        {"name": "a", "token_file": str(tmp_path / "a.token"), "namespaces": [ns]},
        {"name": "b", "token_file": str(tmp_path / "b.token"), "models": ["meta-llama/*"]},
    ]))
    try:
        with pytest.raises(RuntimeError, match="daemon exited") as e:
            d.start()
    finally:
        d.stop()
    msg = str(e.value)
    assert "daemon.tenants[0].namespaces" in msg and "daemon.tenants[1].models" in msg, msg[-800:]
    assert "'a'" in msg and "'b'" in msg and "'meta-llama/*'" in msg, msg[-800:]


def test_register_refuses_another_tenants_listed_namespace_the_config_check_cannot_show(tmp_path: Path) -> None:
    """A model name of only separators slugs to ``model``: no glob's slug shows that, so the config passes. Tenant
    b's glob matches a's model, but Register refuses b that namespace, and b cannot read or overwrite a's blocks."""
    lay = layout("///")
    d = ServeProc(tmp_path, cfg(tmp_path, [
        {"name": "a", "token_file": str(tmp_path / "a.token"), "namespaces": [lay.namespace]},
        {"name": "b", "token_file": str(tmp_path / "b.token"), "models": ["///"]},
    ])).start()
    try:
        token = {t: (tmp_path / f"{t}.token").read_text().strip() for t in "ab"}
        nb = lay.block_nbytes
        ks = [BlockKey(lay.namespace, bytes([1]) * 32)]
        with d.client(tenant_token=token["a"]) as a, d.client(tenant_token=token["b"]) as b:
            a.register(lay)
            a.store(ks, [np.full(nb, 7, dtype=np.uint8)])
            with pytest.raises(DaemonError) as e:
                b.register(lay)
            assert e.value.code == p.E_FORBIDDEN and "tenant 'a'" in str(e.value), str(e.value)
            out = np.zeros(nb, dtype=np.uint8)
            assert a.load(ks, [out]) == 1 and (out == 7).all()
    finally:
        d.stop()
