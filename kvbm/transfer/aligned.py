"""Page alignment for O_DIRECT: the page size, rounding, buffer addresses and a per-thread aligned scratch
buffer."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np

PAGE = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


def address(buf: Any) -> int:
    """Address of a contiguous buffer-protocol object (read-only ones too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class AlignedScratch(threading.local):
    """A page-aligned scratch buffer per thread (mmap memory is page-aligned), grown on demand."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.view: memoryview | None = None

    def get(self, n: int) -> memoryview:
        if self.mm is None or len(self.mm) < n:
            # The old map is left to the GC: slices of it may still be alive in the caller.
            self.mm = mmap.mmap(-1, round_up(max(n, PAGE), 1 << 20))
            self.view = memoryview(self.mm)
        assert self.view is not None
        return self.view[:n]

