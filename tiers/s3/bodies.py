"""BodyBackend: the interface of the S3 tier's block-body movers (:mod:`.http`, :mod:`.aio`, :mod:`.nixl`), and
the reused body buffers of the two that send whole ``header || payload`` buffers (aiobotocore, NIXL)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from kvbm.blocks import MIN_HEADER_LEN, BlockKey, decode_block, encode_block_into

# Checksums of bodies this large run in a thread, not on the event loop.
OFFLOOP_BYTES = 256 * 1024


class BodyBackend(Protocol):
    """Moves block bodies for the S3 tier; control calls stay on aiobotocore."""

    async def put(self, okey: str, key: BlockKey, payload: memoryview, meta: dict[str, str]) -> None:
        """Store ``header || payload`` as ``okey``; raises on any failure (the write did not happen)."""

    async def get_into(self, okey: str, key: BlockKey, view: memoryview) -> int | None:
        """Verified payload of ``okey`` into ``view``: its length, None if there is no such object.
        Raises CorruptBlockError for a corrupt or truncated object, ValueError if ``view`` is too small."""

    def close(self) -> None: ...


class BodyBuffers:
    """``header || payload`` body buffers reused per size (no fresh, page-faulting 8 MiB allocation per block),
    at most ``max_free`` kept per size."""

    def __init__(self, max_free: int) -> None:
        self.max_free = max_free
        self._free: dict[int, list[bytearray]] = {}

    async def encode(self, key: BlockKey, data: memoryview | bytes) -> bytearray:
        """A buffer holding ``header || data``; checksum and copy run off the event loop for large blocks."""
        size = MIN_HEADER_LEN + memoryview(data).nbytes
        free = self._free.setdefault(size, [])
        buf = free.pop() if free else bytearray(size)
        if size >= OFFLOOP_BYTES:
            await asyncio.to_thread(encode_block_into, buf, key, data, MIN_HEADER_LEN)
        else:
            encode_block_into(buf, key, data, MIN_HEADER_LEN)
        return buf

    def release(self, buf: bytearray) -> None:
        free = self._free.setdefault(len(buf), [])
        if len(free) < self.max_free:
            free.append(buf)


def copy_payload(key: BlockKey, body: bytes | bytearray, view: memoryview) -> int:
    """Verify a whole ``header || payload`` body and copy its payload into ``view``; returns its length."""
    payload = decode_block(key, body)
    n = payload.nbytes
    if n > view.nbytes:
        raise ValueError(f"{key}: block is {n} bytes, buffer has {view.nbytes}")
    view[:n] = payload
    return n
