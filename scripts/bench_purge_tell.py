"""How long a daemon takes to reflect a purge of N blocks from its G4 index (the Evict that `kvbm purge` sends).

A real daemon (``python -m kvbm.cli.serve``) on a private SeaweedFS learns N blocks in G4 from a fake peer's events
(no objects needed: the purge already deleted them), then is sent the purge's Evict requests (8,192 hashes each,
as ``kvbm purge`` sends them). Prints one JSON line: blocks, seconds per request (median), total seconds.

    python scripts/bench_purge_tell.py --blocks 100000 [--gone/--no-gone] [--max-s 300]

Run it with ``PYTHONPATH`` pointing at another checkout to measure that code (``--no-gone`` for one that
predates ``Evict.gone``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from kvbm import protocol as p
from kvbm.blocks.layout import KVLayout
from kvbm.client import WorkerClient
from kvbm.s3server import EmbeddedS3

LAYOUT = KVLayout(model="purgebench", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_block=64)
CHUNK = 8192  # hashes per Evict, as kvbm.ops.link sends them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--gone", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-s", type=float, default=300.0, help="stop sending Evicts after this long")
    ap.add_argument("--weed", default=str(Path(sys.executable).parent / "weed"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvbm-purgebench-"))
    srv = EmbeddedS3(tmp / "sw", weed=args.weed, bucket="kvbm-purgebench", stop_timeout_s=2.0, reuse=False)
    srv.start()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    peer = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(peer)
    cfg = {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": "bench", "access_key": srv.access_key,
               "secret_key": srv.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", "metrics_port": 0, "probe": False,
                   "prefetch": False, "peers": [peer], "access_log_interval_s": 0,
                   "admin_token_file": str(tmp / "admin.token")},
    }
    (tmp / "kvbm.yaml").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it until the end
    proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(tmp / "kvbm.yaml")],
                            stdout=log, stderr=log, env=env)
    out: dict[str, object] = {"blocks": args.blocks, "gone": args.gone}
    try:
        deadline = time.monotonic() + 60
        while b"daemon.started" not in (tmp / "daemon.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit((tmp / "daemon.log").read_text()[-2000:])
            time.sleep(0.1)
        token = (tmp / "admin.token").read_text().strip()
        c = WorkerClient(cfg["daemon"]["endpoint"], timeout_s=args.max_s + 60, admin_token=token)
        c.register(LAYOUT, worker_id="bench")
        hashes = [os.urandom(16) for _ in range(args.blocks)]
        seq = 0

        def g4_blocks() -> int:
            return int(next(t for t in c.stats()["tiers"] if t["tier"] == "G4")["blocks"])

        while g4_blocks() < args.blocks:  # a PUB drops what it sends before the SUB is connected: send again
            for i in range(0, args.blocks, 2000):
                ev = p.BlocksStored(namespace=LAYOUT.namespace, hashes=hashes[i : i + 2000], tier="G4",
                                    nbytes=LAYOUT.block_nbytes)
                pub.send_multipart([p.EVENTS_TOPIC, seq.to_bytes(8, "big"),
                                    p.encode(p.EventBatch(ts=time.time(), events=[ev]))])
                seq += 1
            time.sleep(1.0)
        t0 = time.perf_counter()
        per: list[float] = []
        removed = 0
        for i in range(0, args.blocks, CHUNK):
            kw = {"gone": True} if args.gone else {}
            t1 = time.perf_counter()
            rep = c.request(p.Evict(namespace=LAYOUT.namespace, hashes=hashes[i : i + CHUNK], tiers=["G4"], **kw),
                            p.Evicted, args.max_s + 60)
            per.append(time.perf_counter() - t1)
            removed += rep.removed
            if time.perf_counter() - t0 > args.max_s:
                break
        total = time.perf_counter() - t0
        g4 = next(t for t in c.stats()["tiers"] if t["tier"] == "G4")
        out.update(removed=removed, requests=len(per), seconds=round(total, 3),
                   median_request_s=round(statistics.median(per), 3), finished=removed == args.blocks,
                   blocks_per_s=round(removed / total, 1), s3_deletes=g4["stats"]["deletes"],
                   s3_delete_requests=g4["stats"].get("delete_requests"))
        if removed < args.blocks:
            out["extrapolated_s"] = round(total * args.blocks / max(1, removed), 1)
        c.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        pub.close(0)
        srv.stop(force=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
