"""The CUDA paths that cannot run on a machine without a GPU, in one short script for a GPU host.

    python scripts/gpu_check.py            # exits 0 and prints a JSON report; 2 when there is no GPU

It checks, byte for byte: G1 in CUDA memory, G2 pinned with cudaHostRegister, the torch mover's
stream/event copies G2->G1 and G1->G2 through the manager, the NIXL UCX mover with VRAM descriptors
(where NIXL's UCX has CUDA support), and the device-side onboard timing of 8 MiB blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


async def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "skipped": "no CUDA device"}))
        return 2
    from kvbm.blocks import BlockKey
    from kvbm.config import TransferConfig
    from kvbm.manager import BlockManager
    from kvbm.tiers.device import DeviceTier
    from kvbm.tiers.host import HostTier
    from kvbm.transfer import make_memory_mover

    slot, n = 8 << 20, 16
    report: dict[str, object] = {"cuda": True, "device": torch.cuda.get_device_name(0)}
    keys = [BlockKey("gpu-check-0123456789abcdef", os.urandom(16)) for _ in range(n)]
    data = {k: os.urandom(slot) for k in keys}
    for backend in ("plain", "nixl"):
        try:
            mover = make_memory_mover(TransferConfig(backend=backend))
        except Exception as e:
            report[backend] = f"unavailable: {e}"
            continue
        g1 = DeviceTier(n * slot, slot, "cuda")
        g2 = HostTier(n * slot, slot)
        mgr = BlockManager([g1, g2], mover)
        try:
            await mgr.start(index=False)
            assert g1.pool.is_cuda, "G1 is not in CUDA memory"
            for k in keys:
                await mgr.put(k, data[k], tier="G2", cascade=False)
            t = time.perf_counter()
            assert await mgr.onboard(keys, to="G1") == n
            torch.cuda.synchronize()
            up = time.perf_counter() - t
            exact_up = all(bytes(mgr.device_tensor(k).cpu().numpy()) == data[k] for k in keys)
            await mgr.delete(keys, tiers=["G2"])
            t = time.perf_counter()
            assert await mgr.offload(keys) == n
            await mgr.drain()
            down = time.perf_counter() - t
            exact_down = all(await g2.get(k) == data[k] for k in keys)
            report[backend] = {"mover": mover.name, "g2_pinned": g2.pinned, "exact_h2d": exact_up,
                               "exact_d2h": exact_down, "h2d_MBps": round(n * slot / up / 1e6),
                               "d2h_MBps": round(n * slot / down / 1e6)}
        except Exception as e:
            report[backend] = f"failed: {type(e).__name__}: {e}"
        finally:
            await mgr.close()
    print(json.dumps(report, indent=2))
    ok = all(isinstance(v, dict) and v["exact_h2d"] and v["exact_d2h"] for k, v in report.items() if k == "plain")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
