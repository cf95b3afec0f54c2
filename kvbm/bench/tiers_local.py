"""``kvbm bench tiers``'s memory (G1<->G2) and disk (G2<->G3) rows, each next to its raw baseline."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbm.bench.paired import PairRunner
from kvbm.bench.tiers_options import TiersOptions, tier_config
from kvbm.blocks import BlockKey


async def memory_rows(opts: TiersOptions, r: PairRunner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
                  paths: dict[str, Any]) -> None:
    import torch

    from kvbm.stack import build_stack

    stack = await build_stack(tier_config(opts, work), tiers=("G1", "G2"), index=False)
    mgr = stack.manager
    paths["memory_mover"] = getattr(mgr.mover, "name", "?")
    paths["G1_device"] = str(mgr.by_name["G1"].describe().get("device"))
    try:
        for k, a in zip(keys, data, strict=True):
            await mgr.put(k, memoryview(a), tier="G2", cascade=False)
        n = len(keys)
        src = np.stack(data)
        dst = np.empty_like(src)
        dst.fill(0)  # fault the pages in before timing

        def np_copy() -> None:
            for i in range(n):
                np.copyto(dst[i], src[i])

        tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)

        def torch_copy() -> None:
            for i in range(n):
                tdst[i].copy_(tsrc[i])

        async def drop_g1() -> None:
            await mgr.delete(keys, tiers=["G1"])

        async def drop_g2() -> None:
            await mgr.delete(keys, tiers=["G2"])

        async def up() -> None:
            got = await mgr.onboard(keys, to="G1")
            assert got == n, f"onboard G2->G1 moved {got}/{n}"

        async def down() -> None:
            await mgr.offload(keys, durable=True)
            assert all(mgr.registry.holds("G2", k) for k in keys), "offload G1->G2 incomplete"

        mover = paths["memory_mover"]
        await r.pair("G2->G1 copy", f"onboard ({mover})", up, drop_g1, "numpy copyto", np_copy)
        await r.pair("G1->G2 copy", f"offload ({mover})", down, drop_g2, "numpy copyto", np_copy)
        await r.baseline_only("host memcpy", "torch copy_ (reference)", torch_copy)
        # exactness check of what landed in G1
        g1 = mgr.by_name["G1"]
        for k, a in zip(keys[:4], data[:4], strict=False):
            assert (await g1.get(k)) == a.tobytes(), "G1 copy differs"
        await mgr.delete(keys)
    finally:
        await stack.close()


def file_baseline(bdir: Path, data: list[np.ndarray]) -> tuple[Callable[[], None], Callable[[bool], None],
                                                                 Callable[[], None], np.ndarray]:
    bdir.mkdir(parents=True, exist_ok=True)
    files = [str(bdir / f"b{i:05d}.bin") for i in range(len(data))]
    out = np.empty((len(data), data[0].size), dtype=np.uint8)
    out.fill(0)

    def write() -> None:
        for f, a in zip(files, data, strict=True):
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                mv = memoryview(a)
                off = 0
                while off < len(mv):
                    off += os.pwrite(fd, mv[off:], off)
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def drop(cold: bool) -> None:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                if cold:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                else:
                    while os.read(fd, 1 << 22):  # warm it
                        pass
            finally:
                os.close(fd)

    def read() -> None:
        for i, f in enumerate(files):
            fd = os.open(f, os.O_RDONLY)
            try:
                mv = memoryview(out[i])
                got = 0
                while got < len(mv):
                    k = os.preadv(fd, [mv[got:]], got)
                    if k == 0:
                        raise OSError("short read")
                    got += k
            finally:
                os.close(fd)

    return write, drop, read, out


async def disk_rows(opts: TiersOptions, r: PairRunner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
                paths: dict[str, Any]) -> None:
    from kvbm.stack import build_stack

    write, drop, read, _ = file_baseline(work / "raw-files", data)
    n = len(keys)
    for backend in opts.file_io:
        for mode in opts.disk_modes:
            direct = mode == "direct"
            stack = await build_stack(tier_config(opts, work, backend=backend, o_direct=direct), tiers=("G2", "G3"),
                                      index=False)
            mgr = stack.manager
            g3 = mgr.by_name["G3"]
            fio = g3.file_io.name  # type: ignore[attr-defined]
            impl = f"{fio}{'+O_DIRECT' if direct else ''}"
            paths.setdefault("file_io", []).append(impl)
            try:
                for k, a in zip(keys, data, strict=True):
                    await mgr.put(k, memoryview(a), tier="G2", cascade=False)

                async def drop_g3(mgr: Any = mgr) -> None:
                    await mgr.delete(keys, tiers=["G3"])

                async def write_g3(mgr: Any = mgr) -> None:
                    got = await mgr.offload(keys, durable=True)
                    assert got == n, f"offload G2->G3 durable {got}/{n}"

                await r.pair("G2->G3 write", f"offload ({impl})", write_g3, drop_g3, "pwrite+fdatasync", write)

                for cold in (True, False):
                    async def prep(mgr: Any = mgr, g3: Any = g3, cold: bool = cold) -> None:
                        await mgr.delete(keys, tiers=["G2"])

                        def pages() -> None:
                            for k in keys:
                                if cold:
                                    g3.drop_page_cache(k)
                                else:
                                    with open(g3.path_for(k), "rb") as f:
                                        while f.read(1 << 22):
                                            pass

                        await asyncio.to_thread(pages)

                    async def read_g3(mgr: Any = mgr) -> None:
                        got = await mgr.onboard(keys, to="G2")
                        assert got == n, f"onboard G3->G2 moved {got}/{n}"

                    label = "cold" if cold else "warm"
                    await r.pair(f"G3->G2 read {label}", f"onboard ({impl})", read_g3, prep, f"pread ({label})",
                                 read, lambda cold=cold: drop(cold))
                g2 = mgr.by_name["G2"]
                for k, a in zip(keys[:4], data[:4], strict=False):
                    assert (await g2.get(k)) == a.tobytes(), "G3 round trip differs"
                r.rows[-1]["io_modes"] = dict(g3.file_io.modes)  # type: ignore[attr-defined]
                await mgr.delete(keys)
            finally:
                await stack.close()
