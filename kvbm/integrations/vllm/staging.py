"""Host buffers for the saves of a request vLLM freed at its finish (issue 36, the in-process weight sync).

kvbm never keeps a finished request's vLLM blocks: vLLM's in-process engine resets its prefix cache (an RL weight
sync: ``LLM.sleep``, ``pause_generation(clear_cache=True)``, ``reset_prefix_cache``) without stepping first, and
a block still held makes that reset fail or raise. So a finished request's saves that have not read its blocks
yet (its last blocks and its partial block, planned at its finish; saves of its last steps still waiting for
their slots) are copied here on the engine's thread, before the next forward can reuse the blocks: one memcpy
on a CPU engine, a copy queued on the current stream on a GPU (the forward is queued after it; the host does
not wait). The saver thread later writes these buffers into G2 slots, off the engine's thread.

At most ``step_bytes`` are copied per step (the time a step may spend) and ``step_bytes * HELD_STEPS`` held in
all (memory): a save past either is dropped and counted, never waited for on the daemon.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

HELD_STEPS = 4  # buffers held in all, in steps' worth of copies: the saver thread frees them as it writes


class Staging:
    """Copies vLLM blocks into host buffers on the engine's thread; gives the buffers back once saved."""

    def __init__(self, copy_out: Callable[[torch.Tensor, list[int], Any], None],
                 nbytes_of: Callable[[list[int]], int], step_bytes: int) -> None:
        # copy_out(buffer, vLLM block ids, stream): the paged cache's copy out of vLLM's blocks
        self._copy_out, self._nbytes_of = copy_out, nbytes_of
        self.step_bytes, self.max_bytes = step_bytes, step_bytes * HELD_STEPS
        self._cuda = torch.cuda.is_available()
        self._free: dict[int, list[torch.Tensor]] = {}  # buffers given back, by size
        self._step = 0  # bytes copied this step
        self.held = 0  # bytes in buffers not given back yet
        self._lock = threading.Lock()  # the saver thread gives buffers back

    def new_step(self) -> None:
        self._step = 0

    def fits(self, block_ids: list[list[int]]) -> bool:
        n = sum(self._nbytes_of(ids) for ids in block_ids)
        return self._step + n <= self.step_bytes and self.held + n <= self.max_bytes

    def take(self, block_ids: list[list[int]]) -> tuple[list[torch.Tensor], Any]:
        """One buffer per kvbm block, with its vLLM blocks ``block_ids[i]`` copied in, and what to wait on before
        reading them (a CUDA event; None on a CPU engine, whose copy is over on return). Call :meth:`fits` first."""
        stream = torch.cuda.current_stream() if self._cuda else None
        bufs: list[torch.Tensor] = []
        for ids in block_ids:
            n = self._nbytes_of(ids)
            with self._lock:
                free = self._free.get(n)
                buf = free.pop() if free else None
                self.held += n
            if buf is None:
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=self._cuda)
            self._copy_out(buf, ids, stream)
            bufs.append(buf)
            self._step += n
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
        return bufs, ready

    def give_back(self, bufs: list[torch.Tensor]) -> None:
        """Buffers written to G2 (or dropped): kept for reuse, within the held budget (a fresh buffer costs its
        page faults on the engine's thread, 3x the copy of 8 MiB here; pinning one on a GPU host, milliseconds)."""
        with self._lock:
            for buf in bufs:
                self.held -= buf.numel()
                self._free.setdefault(buf.numel(), []).append(buf)
            kept = sum(b.numel() for bs in self._free.values() for b in bs)
            for bs in self._free.values():
                while bs and kept > self.max_bytes:
                    kept -= bs.pop().numel()


def write(view: torch.Tensor, buf: torch.Tensor) -> None:
    """A staged buffer into a G2 slot (host memory both): one memmove, the GIL released, no torch threads."""
    n = buf.numel()
    if view.numel() * view.element_size() < n:
        raise ValueError(f"kvbm: a slot of {view.numel() * view.element_size()} B cannot hold a staged {n} B")
    ctypes.memmove(view.data_ptr(), buf.data_ptr(), n)
