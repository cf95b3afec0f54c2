"""The GPU paths in one short command for a GPU host; runs on CPU too, skipping only what needs CUDA.

    python scripts/gpu_check.py [--require-cuda] [--blocks 16] [--slot-mib 8]

Each check copies random bytes and compares them byte for byte, and reports GB/s:
* ``movers``: G1 (DeviceTier in CUDA memory) and G2 (HostTier, pinned with cudaHostRegister), G2->G1 onboard
  and G1->G2 offload through the manager, with the torch mover (stream/event copies) and the NIXL UCX mover
  (VRAM descriptors for G1; NIXL without CUDA in its UCX says so and is reported, not failed).
* ``paged``: the connector's worker-side copy (kvbm.integrations.vllm.paged) on vLLM's paged layout (flash
  layout ``[2, num_blocks, block_size, kv_heads, head_size]`` per layer on CUDA): scattered vLLM blocks
  gathered into a pinned G2 slot and back into other blocks, non_blocking on a side CUDA stream.
* ``worker``: the connector's WorkerSide against a real daemon (``kvbm serve`` in a subprocess): the async
  save (saver thread, its own CUDA stream after an event) then the async load (loader thread) into other
  vLLM blocks; needs vLLM importable (the GPU host's vLLM environment).
* ``native``: vLLM's own offloading with kvbm below it: ``vllm serve`` (a tiny random Llama) with
  ``OffloadingConnector`` + ``TieringOffloadingSpec`` + kvbm's secondary tier (docs/native-tier.md) and a real
  daemon; a prompt run cold, again after ``/reset_prefix_cache`` (a hit), then again after the engine was
  restarted (vLLM's CPU tier died with it: the hit comes from kvbm), the same text every time. CUDA only
  (vLLM's CPU worker copies between CUDA tensors and its CPU tier).
Prints one JSON report; ``skipped`` names what did not run and why. Exit 0 when every check that ran was
byte-exact, 1 otherwise, 2 with ``--require-cuda`` on a host without CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GB = 1e9
CUDA_ONLY = {
    "g1_cuda": "G1 in CUDA memory (here G1 is CPU memory)",
    "g2_pinned": "G2 pinned with cudaHostRegister",
    "nixl_vram": "NIXL VRAM descriptors",
    "cuda_streams": "non_blocking copies on side CUDA streams (the save stream waits on an event)",
}


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


async def movers(cuda: bool, n: int, slot: int) -> dict[str, Any]:
    """G2->G1 and G1->G2 through the manager with each mover."""
    from kvbm.blocks import BlockKey
    from kvbm.config import TransferConfig
    from kvbm.manager.core import BlockManager
    from kvbm.tiers.device import DeviceTier
    from kvbm.tiers.host import HostTier
    from kvbm.transfer import make_memory_mover

    keys = [BlockKey("gpu-check-0123456789abcdef", os.urandom(16)) for _ in range(n)]
    data = {k: os.urandom(slot) for k in keys}
    out: dict[str, Any] = {}
    for backend in ("plain", "nixl"):
        try:
            mover = make_memory_mover(TransferConfig(backend=backend))
        except Exception as e:
            out[backend] = {"ran": False, "why": f"{type(e).__name__}: {e}"}
            continue
        g1 = DeviceTier(n * slot, slot, "cuda" if cuda else "cpu")
        g2 = HostTier(n * slot, slot)
        mgr = BlockManager([g1, g2], mover)
        try:
            await mgr.start(index=False)
            for k in keys:
                await mgr.put(k, data[k], tier="G2", cascade=False)
            t = time.perf_counter()
            assert await mgr.onboard(keys, to="G1") == n
            _sync(cuda)
            up = time.perf_counter() - t
            exact_up = all(bytes(mgr.device_tensor(k).cpu().numpy()) == data[k] for k in keys)
            await mgr.delete(keys, tiers=["G2"])
            t = time.perf_counter()
            assert await mgr.offload(keys) == n
            await mgr.drain()
            down = time.perf_counter() - t
            exact_down = all([await g2.get(k) == data[k] for k in keys])  # a list: all() of an async genexp raises
            out[backend] = {"ran": True, "mover": mover.name, "g1": str(g1.device), "g2_pinned": g2.pinned,
                            "g1_mem": "VRAM" if g1.pool.is_cuda else "DRAM", "bytes": n * slot,
                            "exact": exact_up and exact_down, "exact_g2_to_g1": exact_up,
                            "exact_g1_to_g2": exact_down, "g2_to_g1_GBps": round(n * slot / up / GB, 3),
                            "g1_to_g2_GBps": round(n * slot / down / GB, 3)}
        except Exception as e:
            # NIXL whose UCX lacks CUDA cannot register VRAM: reported as not run, with NIXL's words.
            ran = backend == "plain" or not cuda
            out[backend] = {"ran": ran, "exact": False, "why": f"{type(e).__name__}: {e}"}
        finally:
            await mgr.close()
    return out


def kv_caches(cuda: bool, layers: int, num_blocks: int, bs: int, heads: int, head: int) -> dict[str, torch.Tensor]:
    """Random per-layer KV caches as vLLM allocates them: flash layout on CUDA, block-major on CPU."""
    shape = (2, num_blocks, bs, heads, head) if cuda else (num_blocks, 2, bs, heads, head)
    dev = "cuda" if cuda else "cpu"
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, dtype=torch.bfloat16, device=dev)
            for i in range(layers)}


def paged(cuda: bool, geo: dict[str, int]) -> dict[str, Any]:
    """PagedCache's gather into a (pinned) G2 slot and scatter back into other blocks, on a side stream."""
    from kvbm.integrations.vllm.paged import PagedCache
    from kvbm.tiers.host import HostTier

    caches = kv_caches(cuda, geo["layers"], geo["num_blocks"], geo["bs"], geo["heads"], geo["head"])
    cache = PagedCache(caches, geo["num_blocks"])
    k, rounds = geo["k"], geo["rounds"]
    nbytes = cache.vblock_bytes * k
    g2 = HostTier(rounds * nbytes, nbytes)
    # Scattered source blocks, and other destination blocks, as a prefix load would get them.
    src = [list(range(3 + 2 * k * r, 3 + 2 * k * r + 2 * k, 2)) for r in range(rounds)]
    dst = [[b + 1 for b in blocks] for blocks in src]
    stream = torch.cuda.Stream() if cuda else None
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    t = time.perf_counter()
    with ctx:
        if stream is not None:
            stream.wait_stream(torch.cuda.default_stream())  # the "forward" that wrote the cache
        for r in range(rounds):
            cache.copy(g2.slot_tensor(r, nbytes), src[r], False, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()
    save = time.perf_counter() - t
    t = time.perf_counter()
    with ctx:
        for r in range(rounds):
            cache.copy(g2.slot_tensor(r, nbytes), dst[r], True, non_blocking=cuda)
        if stream is not None:
            stream.synchronize()
    load = time.perf_counter() - t
    exact = all(torch.equal(c.select(bd, d), c.select(bd, s)) for _n, c, bd, _g, _nb in cache.layers
                for r in range(rounds) for s, d in zip(src[r], dst[r], strict=True))
    total = rounds * nbytes
    asyncio.run(g2.close())
    return {"ran": True, "layout": list(next(iter(caches.values())).shape), "vblock_bytes": cache.vblock_bytes,
            "k": k, "bytes": total, "g2_pinned": g2.pinned, "stream": stream is not None, "exact": exact,
            "gather_GBps": round(total / save / GB, 3), "scatter_GBps": round(total / load / GB, 3)}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _daemon(tmp: Path, slot: int, capacity: int) -> tuple[subprocess.Popen[bytes], str]:
    """``kvbm serve`` with G2 only, on an ipc socket in ``tmp``; returns once it logged daemon.started."""
    endpoint = f"ipc://{tmp}/kvbm.sock"
    cfg = {"block_bytes": slot, "device": {"enabled": False}, "host": {"capacity": capacity},
           "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
           "daemon": {"endpoint": endpoint, "events_endpoint": f"ipc://{tmp}/events.sock", "metrics_port": -1,
                      "admin_token_file": str(tmp / "admin.token")}}
    (tmp / "kvbm.yaml").write_text(json.dumps(cfg))
    log = tmp / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvbm.cli.serve", "--config", str(tmp / "kvbm.yaml")],
                                stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while b'"daemon.started"' not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"daemon did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, endpoint


def _wait(pred: Any, what: str, timeout: float = 60) -> float:
    t = time.perf_counter()
    while not pred():
        if time.perf_counter() - t > timeout:
            raise TimeoutError(f"{what} did not finish in {timeout:.0f} s")
        time.sleep(0.001)
    return time.perf_counter() - t


def worker(cuda: bool, geo: dict[str, int]) -> dict[str, Any]:
    """WorkerSide's async save then async load against a real daemon."""
    try:
        from kvbm.integrations.vllm.config import ConnectorConfig
        from kvbm.integrations.vllm.geometry import Geometry
        from kvbm.integrations.vllm.link import Links
        from kvbm.integrations.vllm.metadata import BlockTransfer, KvbmConnectorMetadata
        from kvbm.integrations.vllm.worker import WorkerSide
    except ImportError as e:
        return {"ran": False, "why": f"needs vLLM importable (the connector's base class): {e}"}
    from kvbm.blocks.layout import KVLayout

    k, bs, rounds = geo["k"], geo["bs"], geo["rounds"]
    caches = kv_caches(cuda, geo["layers"], geo["num_blocks"], bs, geo["heads"], geo["head"])
    vblock = sum(t.select(1 if cuda else 0, 0).numel() * t.element_size() for t in caches.values())
    with tempfile.TemporaryDirectory(prefix="kvbm-gpucheck-") as d:
        proc, endpoint = _daemon(Path(d), vblock * k, 4 * rounds * vblock * k)
        ws = None
        try:
            cfg = ConnectorConfig.parse({"daemon": endpoint, "vllm_blocks_per_kvbm_block": k, "async_load": True,
                                         "async_save": True, "timeout_s": 30})
            geometry = Geometry(bs, vblock, k)

            def layout_of(rank: int, kk: int) -> KVLayout:
                return KVLayout(model="gpu-check", num_layers=geo["layers"], num_kv_heads=geo["heads"],
                                head_size=geo["head"], dtype="bfloat16", tp_rank=rank, tokens_per_block=kk * bs,
                                backend="gpu-check/" + ("cuda" if cuda else "cpu"))

            ws = WorkerSide(cfg, Links(endpoint, geometry, "gpu-check", 30.0, layout_of), 0, geo["num_blocks"])
            ws.register_kv_caches(caches)
            hashes = [hashlib.sha256(os.urandom(16)).digest() for _ in range(rounds)]
            src = [list(range(2 + 2 * k * r, 2 + 2 * k * r + 2 * k, 2)) for r in range(rounds)]
            dst = [[b + 1 for b in blocks] for blocks in src]
            save = KvbmConnectorMetadata(saves=[BlockTransfer("save", hashes, src)], k=k)
            t = time.perf_counter()
            ws.wait_for_save(save)
            _wait(lambda: "save" in (ws.get_finished({"save"})[0] or set()), "async save")
            t_save = time.perf_counter() - t
            load = KvbmConnectorMetadata(loads=[BlockTransfer("load", hashes, dst)], k=k)
            t = time.perf_counter()
            ws.start_load_kv(load)
            _wait(lambda: "load" in (ws.get_finished(set())[1] or set()), "async load")
            _sync(cuda)
            t_load = time.perf_counter() - t
            errors = sorted(ws.get_block_ids_with_load_errors())
            bd = 1 if cuda else 0
            exact = not errors and all(torch.equal(c.select(bd, dd), c.select(bd, s)) for c in caches.values()
                                       for r in range(rounds) for s, dd in zip(src[r], dst[r], strict=True))
            total = rounds * vblock * k
            return {"ran": True, "async_save": True, "async_load": True, "save_stream": ws.saver.stream is not None,
                    "bytes": total, "load_errors": errors, "exact": exact,
                    "save_GBps": round(total / t_save / GB, 3), "load_GBps": round(total / t_load / GB, 3)}
        finally:
            if ws is not None:
                ws.shutdown()
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def native(cuda: bool, geo: dict[str, int]) -> dict[str, Any]:
    """vllm serve with vLLM's native offloading and kvbm's tier below it: hits after reset_prefix_cache and after
    an engine restart."""
    if not cuda:
        return {"ran": False, "why": "vLLM's OffloadingConnector runs on CUDA only (its CPU worker copies between "
                                     "CUDA tensors and its CPU tier); tests/integration/test_vllm_native_tier.py "
                                     "runs the tier under vLLM's real manager on CPU"}
    try:
        import openai  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as e:
        return {"ran": False, "why": f"needs vLLM and openai importable: {e}"}
    from kvbm.bench.openai_server import (
        ModelSpec,
        VllmServer,
        client,
        free_port,
        server_command,
        stream_completion,
        words,
        write_model,
    )
    from kvbm.client import WorkerClient
    from kvbm.integrations.vllm.native_config import kv_transfer_config

    def daemon_stats(endpoint: str) -> dict[str, Any]:
        with WorkerClient(endpoint, timeout_s=10) as c:
            return c.stats()

    def g2_blocks(stats: dict[str, Any]) -> int:
        return sum(int(t.get("blocks", 0)) for t in stats["tiers"] if t.get("tier") == "G2")

    with tempfile.TemporaryDirectory(prefix="kvbm-gpucheck-native-") as d:
        tmp = Path(d)
        proc, endpoint = _daemon(tmp, 64 << 10, 64 << 20)  # 64 KiB blocks: a 16-token chunk of the model is 8 KiB
        try:
            model = write_model(tmp / "model", ModelSpec())
            ktc = kv_transfer_config(256 << 20, daemon=endpoint, timeout_s=10.0)
            cmd = server_command(model, free_port(), connector=ktc, block_size=16, max_model_len=2048,
                                 kv_bytes=256 << 20, extra=["--gpu-memory-utilization", "0.3"])
            prompt = words([3 + (i * 7) % 900 for i in range(1024)])  # 1024 tokens: 64 chunks of 16

            def ask(srv: VllmServer) -> Any:
                return asyncio.run(stream_completion(client(srv), srv.model, prompt, 8))

            runs: dict[str, Any] = {}
            with VllmServer(cmd, tmp / "vllm-1.log") as srv:
                runs["cold"] = ask(srv)
                _wait(lambda: g2_blocks(daemon_stats(endpoint)) >= 32, "kvbm storing the prompt's chunks", 120)
                srv.reset_prefix_cache()
                runs["after_reset"] = ask(srv)
            before = daemon_stats(endpoint)["manager"]
            with VllmServer(cmd, tmp / "vllm-2.log") as srv:  # a new engine: vLLM's CPU tier starts empty
                runs["after_restart"] = ask(srv)
            after = daemon_stats(endpoint)["manager"]
            texts = {r.text for r in runs.values()}
            onboarded = after["onboard_blocks"] - before["onboard_blocks"]
            exact = (len(texts) == 1 and not any(r.error for r in runs.values())
                     and (runs["after_reset"].cached_tokens or 0) > 0 and (runs["after_restart"].cached_tokens or 0) > 0
                     and onboarded > 0)
            return {"ran": True, "exact": exact, "kv_transfer_config": ktc, "same_text": len(texts) == 1,
                    "kvbm_onboarded_blocks_after_restart": onboarded,
                    **{f"{k}_cached_tokens": r.cached_tokens for k, r in runs.items()},
                    **{f"{k}_ttft_s": r.ttft_s for k, r in runs.items()},
                    **{f"{k}_error": r.error for k, r in runs.items() if r.error}}
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--require-cuda", action="store_true", help="exit 2 (after the report) without CUDA")
    ap.add_argument("--blocks", type=int, default=0, help="blocks per mover check (default 16 on CUDA, 8 on CPU)")
    ap.add_argument("--slot-mib", type=int, default=0, help="block size in MiB (default 8 on CUDA, 2 on CPU)")
    args = ap.parse_args()
    # NIXL and vLLM log to stdout: send fd 1 to stderr while the checks run, so stdout is the JSON only.
    sys.stdout.flush()
    json_out = os.dup(1)
    os.dup2(2, 1)
    cuda = torch.cuda.is_available()
    n = args.blocks or (16 if cuda else 8)
    slot = (args.slot_mib or (8 if cuda else 2)) << 20
    # vLLM-like geometry: 8 layers x 16-token blocks x 8 KV heads x 128 (bf16) = 512 KiB per vLLM block.
    geo = {"layers": 8, "bs": 16, "heads": 8, "head": 128, "num_blocks": 256, "k": 4, "rounds": 8}
    report: dict[str, Any] = {"cuda": cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "torch": torch.__version__, "python": sys.version.split()[0],
                              "skipped": {} if cuda else dict(CUDA_ONLY), "checks": {}}
    t0 = time.perf_counter()
    checks = report["checks"]
    checks["movers"] = asyncio.run(movers(cuda, n, slot))
    for name, fn in (("paged", paged), ("worker", worker), ("native", native)):
        try:
            checks[name] = fn(cuda, geo)
        except Exception as e:
            checks[name] = {"ran": True, "exact": False, "why": f"{type(e).__name__}: {e}"}
    ran = {f"movers.{b}": v for b, v in checks["movers"].items()} | {k: v for k, v in checks.items() if k != "movers"}
    for name, v in ran.items():
        if not v["ran"]:
            report["skipped"][name] = v["why"]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = all(v["exact"] for v in ran.values() if v["ran"]) and ran["movers.plain"]["ran"]
    sys.stdout.flush()
    os.dup2(json_out, 1)
    print(json.dumps(report, indent=2))
    if args.require_cuda and not cuda:
        return 2
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
