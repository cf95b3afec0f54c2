"""One process of the slot-lifetime stress test: ``python slots_stress_worker.py ROLE ENDPOINT SECONDS SEED``.

Roles: ``writer`` stores random batches of the shared keys, ``reader`` looks them up (which prefetches
from G3) and loads them, checking every loaded block byte for byte, ``evictor`` evicts G2 copies. Prints
one JSON line of counts.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient
from kvbm.security import read_admin_token

SLOT = 64 * 1024
LAYOUT = KVLayout(model="stress", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT.block_nbytes
KEYS = [BlockKey(LAYOUT.namespace, (b"stress" + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(64)]
_cache: dict[BlockKey, np.ndarray] = {}


def payload(key: BlockKey) -> np.ndarray:
    """Each key's bytes: distinct per key, the same in every process."""
    if key not in _cache:
        rng = np.random.default_rng(int.from_bytes(key.hash[:10], "big"))
        _cache[key] = rng.integers(0, 256, NB, dtype=np.uint8)
    return _cache[key]


def main() -> None:
    role, endpoint, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    # Evicting needs the daemon's admin token: the evictor reads its file (argv[5]) as a user would.
    admin_token = read_admin_token(Path(sys.argv[5])) if role == "evictor" else ""
    rng = random.Random(seed)
    counts = {"role": role, "ops": 0, "loaded": 0, "wrong": 0, "stored": 0, "evicted": 0, "full": 0, "errors": []}
    c = WorkerClient(endpoint, timeout_s=30, admin_token=admin_token)
    c.register(LAYOUT, worker_id=f"{role}-{seed}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = rng.sample(KEYS, rng.randint(1, 3))
        try:
            if role == "writer":
                counts["stored"] += c.store(batch, [payload(k) for k in batch]).stored
            elif role == "reader":
                c.lookup(batch)
                outs = [np.zeros(NB, np.uint8) for _ in batch]
                n = c.load(batch, outs)
                counts["loaded"] += n
                counts["wrong"] += sum(not np.array_equal(outs[i], payload(batch[i])) for i in range(n))
            else:
                counts["evicted"] += c.evict(batch, tiers=["G2"]).removed
        except DaemonError as e:
            if e.code not in (p.E_FULL, "shed"):  # a full G2 under pins, or shed load: retry
                counts["errors"].append(str(e)[:200])
            counts["full"] += 1
        except DaemonUnavailable as e:
            counts["errors"].append(str(e)[:200])
        counts["ops"] += 1
    c.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
