"""A slow (not down) S3 (issue 37, D12): a Register waits a bounded time for its namespace's bucket listing, then
is answered while the listing goes on in the background.

Real parts: ``kvbm serve`` in a subprocess (tests/serve_proc.py), SeaweedFS behind the chaos fault proxy
(kvbm.chaos.proxy), which holds every S3 answer back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serve_proc import ServeProc, wait_until

from kvbm.blocks.layout import KVLayout
from kvbm.chaos.proxy import FaultProxy, FaultRates

pytestmark = pytest.mark.s3

LAYOUT = KVLayout(model="slow-s3", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)


def test_register_waits_a_bounded_time_for_a_slow_namespace_listing(s3_server, s3_prefix: str,
                                                                    tmp_path: Path) -> None:
    """S3 answers after 8 s, ``index_bucket: lazy``, ``register_index_wait_s`` 1: the Register is answered
    within the client's 5 s (it waited out the whole listing before), and the log says the listing goes on."""
    proxy = FaultProxy(("127.0.0.1", int(s3_server.endpoint.rsplit(":", 1)[1]))).start()
    cfg = {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "16MiB", "fsync": False, "o_direct": False},
        "s3": {"endpoint": proxy.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "max_retries": 0,
               "read_timeout_s": 60.0},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0,
                   "index_bucket": "lazy", "register_index_wait_s": 1.0, "probe": False},
    }
    d = ServeProc(tmp_path, cfg).start()
    try:
        proxy.rates = FaultRates(latency=1.0, latency_s=(8.0, 8.0))
        with d.client(timeout_s=5.0) as c:
            reg = c.register(LAYOUT, worker_id="w")
            assert reg.namespace == LAYOUT.namespace
            assert wait_until(lambda: '"register.index_pending"' in d.log_path.read_text(), timeout=10)
    finally:
        d.stop()
        time.sleep(8.0)  # the proxy's held answers end before it stops (its loop closes with none pending)
        proxy.stop()
