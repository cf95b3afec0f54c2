"""How a daemon over a non-empty bucket learns what the bucket holds (daemon.index_bucket)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from serve_proc import ServeProc

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import WorkerClient
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

A = KVLayout(model="bucket-a", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
B = KVLayout(model="bucket-b", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)


def put_blocks(srv, prefix: str, layout: KVLayout, n: int) -> list[BlockKey]:
    keys = [BlockKey(layout.namespace, os.urandom(16)) for _ in range(n)]

    async def go() -> None:
        t = make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))
        await t.start()
        for k in keys:
            await t.put(k, os.urandom(layout.block_nbytes))
        await t.close()

    asyncio.run(go())
    return keys


def start_daemon(tmp_path, srv, prefix: str, mode: str) -> ServeProc:
    return ServeProc(tmp_path, {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(tmp_path / "disk"), "capacity": "16MiB", "fsync": False},
        "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
               "secret_key": srv.secret_key},
        "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": 0,
                   "index_bucket": mode},
    }).start()


def g4_blocks(c: WorkerClient) -> int:
    return {t["tier"]: t["blocks"] for t in c.stats()["tiers"]}["G4"]


@pytest.mark.parametrize("mode", ["lazy", "background"])
def test_daemon_learns_the_bucket_per_namespace_or_in_the_background(tmp_path, s3_server, s3_prefix, mode):
    a = put_blocks(s3_server, s3_prefix, A, 5)
    b = put_blocks(s3_server, s3_prefix, B, 3)
    d = start_daemon(tmp_path, s3_server, s3_prefix, mode)
    try:
        with d.client() as c:
            if mode == "lazy":
                assert g4_blocks(c) == 0 and not c.stats()["daemon"]["bucket_indexed"]
            c.register(A, worker_id="a")  # lists namespace A before answering
            hit = c.lookup(a)  # once: the prefetch it starts may bring the blocks up to G2 before a second
            assert hit.matched == 5 and hit.tiers == ["G4"] * 5
            if mode == "lazy":
                assert g4_blocks(c) == 5  # B was never listed
            else:
                deadline = time.monotonic() + 20
                while not c.stats()["daemon"]["bucket_indexed"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert g4_blocks(c) == 8
            with d.client() as c2:
                c2.register(B, worker_id="b")
                assert c2.lookup(b).matched == 3
            assert g4_blocks(c) == 8
    finally:
        d.stop()
