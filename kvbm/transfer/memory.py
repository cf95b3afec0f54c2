"""Memory-to-memory copies between registered pools: torch/memcpy (plain) or NIXL UCX, and the factory."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvbm.config import TransferConfig
from kvbm.transfer.nixl_agent import ProgressPump, TransferBackendError, new_agent, require_nixl, wait_xfer


class MemoryMover(Protocol):
    name: str

    def register(self, pool: torch.Tensor) -> None: ...
    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def close(self) -> None: ...


def _bytes_np(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _check_pool(pool: torch.Tensor) -> None:
    if pool.dtype != torch.uint8 or not pool.is_contiguous():
        raise ValueError("a transfer pool must be a contiguous uint8 tensor")


class TorchMemoryMover:
    """Plain copies: ``dst.copy_(src)``; CUDA copies run on a dedicated stream and wait on an event."""

    name = "torch"

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def register(self, pool: torch.Tensor) -> None:
        _check_pool(pool)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for src, dst in pairs:
            if src.numel() != dst.numel():
                raise ValueError(f"copy of {src.numel()} elements into {dst.numel()}")
        cuda = next((t.device for p in pairs for t in p if t.is_cuda), None)
        if cuda is None:
            for src, dst in pairs:
                if src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous():
                    # A plain memcpy: torch's intra-op threads make copy_ ~5x slower on few cores.
                    np.copyto(_bytes_np(dst), _bytes_np(src))
                else:
                    dst.copy_(src)
            return
        # CUDA: one side stays on the host (or both are on a GPU): async copies on our own stream.
        stream = self._streams.get(cuda)
        if stream is None:
            stream = self._streams[cuda] = torch.cuda.Stream(device=cuda)
        stream.wait_stream(torch.cuda.current_stream(cuda))
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def close(self) -> None:
        self._streams.clear()


class NixlMemoryMover:
    """Two in-process NIXL agents over UCX; every pool is registered with both, copies are WRITEs."""

    name = "nixl-ucx"

    def __init__(self) -> None:
        api = require_nixl()
        try:
            self._src = new_agent(api, "kvbm-src", "UCX")
            self._dst = new_agent(api, "kvbm-dst", "UCX")
        except Exception as e:
            raise TransferBackendError(f"NIXL UCX backend does not create: {e}") from e
        self._remote = self._src.add_remote_agent(self._dst.get_agent_metadata()).decode()
        self._pump = ProgressPump(self._dst, "kvbm-dst-progress")  # the WRITEs' target: its side of the wireup
        self._pools: list[tuple[int, int, str, int, torch.Tensor]] = []  # start, end, mem type, dev, pool
        self._regs: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def register(self, pool: torch.Tensor) -> None:
        _check_pool(pool)
        start = pool.data_ptr()
        if any(s == start for s, *_ in self._pools):
            return
        mem = "VRAM" if pool.is_cuda else "DRAM"
        dev = (pool.device.index or 0) if pool.is_cuda else 0
        with self._lock:
            regs = (self._src.register_memory(pool), self._dst.register_memory(pool))
            self._regs.append(regs)
            # The source agent must see the destination's new registration.
            self._src.add_remote_agent(self._dst.get_agent_metadata())
            self._pools.append((start, start + pool.numel(), mem, dev, pool))

    def _find(self, t: torch.Tensor) -> tuple[str, int]:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        for start, end, mem, dev, _ in self._pools:
            if start <= a and a + n <= end:
                return mem, dev
        raise ValueError(f"tensor at {a:#x}+{n} is not inside a pool registered with {self.name}")

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        groups: dict[tuple[str, str], tuple[list, list]] = {}
        for src, dst in pairs:
            n = src.numel() * src.element_size()
            if n != dst.numel() * dst.element_size():
                raise ValueError(f"copy of {n} bytes into {dst.numel() * dst.element_size()}")
            if not (src.is_contiguous() and dst.is_contiguous()):
                raise ValueError("NIXL copies need contiguous views")
            if n == 0:
                continue
            (smem, sdev), (dmem, ddev) = self._find(src), self._find(dst)
            s_list, d_list = groups.setdefault((smem, dmem), ([], []))
            s_list.append((src.data_ptr(), n, sdev))
            d_list.append((dst.data_ptr(), n, ddev))
        # One transfer per (source, destination) memory-type pair: a descriptor list has one type.
        for (smem, dmem), (s_list, d_list) in groups.items():
            with self._lock:
                handle = self._src.initialize_xfer(
                    "WRITE",
                    self._src.get_xfer_descs(s_list, smem),
                    self._src.get_xfer_descs(d_list, dmem),
                    self._remote,
                )
            wait_xfer(self._src, handle, f"UCX {smem}->{dmem} copy of {len(s_list)} blocks")

    def close(self) -> None:
        with self._lock:
            for rs, rd in self._regs:
                self._src.deregister_memory(rs)
                self._dst.deregister_memory(rd)
            self._regs.clear()
            self._pools.clear()
        self._pump.stop()


def make_memory_mover(cfg: TransferConfig | None = None) -> MemoryMover:
    """``nixl`` -> NIXL UCX; ``plain`` and ``auto`` -> direct copies.

    ``auto`` picks direct copies for memory because, inside one process, a CUDA copy engine or a
    memcpy is the shortest path (measured here: 3.2-5.7 GB/s memcpy vs 1.2-1.4 GB/s through UCX for
    CPU pools); NIXL UCX pays off when the other side is another process or host.
    """
    cfg = cfg or TransferConfig()
    if cfg.backend == "nixl":
        return NixlMemoryMover()
    return TorchMemoryMover()
