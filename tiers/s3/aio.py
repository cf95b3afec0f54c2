"""The ``aiobotocore`` body backend: block bodies through the tier's shared aiobotocore client (asyncio streams,
one copy per received chunk); xxh3 checksums of large bodies run in a thread, not on the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from kvbm.blocks import MIN_HEADER_LEN, BlockKey, unpack_header, verify
from kvbm.errors import CorruptBlockError
from kvbm.tiers.s3.bodies import OFFLOOP_BYTES, BodyBuffers
from kvbm.tiers.s3.codes import MISS_CODES, error_code

HEADER_LEN = MIN_HEADER_LEN


async def _read_exact(stream: Any, dst: memoryview, key: BlockKey) -> None:
    """Fill ``dst`` from a response body, copying each received chunk once."""
    pos, n = 0, dst.nbytes
    while pos < n:
        chunk = await stream.read(n - pos)
        if not chunk:
            raise CorruptBlockError(f"{key}: object truncated ({pos} of {n} bytes)")
        dst[pos : pos + len(chunk)] = chunk
        pos += len(chunk)


class AioBody:
    """:class:`~kvbm.tiers.s3.bodies.BodyBackend` over aiobotocore: PUT sends ``header || payload`` from a reused
    body buffer (botocore takes whole buffers, not views); GET streams straight into the caller's view."""

    def __init__(self, s3: Any, bucket: str, max_free: int) -> None:
        self._s3 = s3
        self.bucket = bucket
        self._buffers = BodyBuffers(max_free)

    async def put(self, okey: str, key: BlockKey, payload: memoryview, meta: dict[str, str]) -> None:
        buf = await self._buffers.encode(key, payload)
        try:
            await self._s3.put_object(Bucket=self.bucket, Key=okey, Body=buf, Metadata=meta)
        finally:
            self._buffers.release(buf)

    async def get_into(self, okey: str, key: BlockKey, view: memoryview) -> int | None:
        """GET straight into ``view``: each received chunk is copied once, then the payload is verified.

        On a corrupt object ``view`` may hold garbage; the caller gets CorruptBlockError and must not
        use it (the manager aborts the slot).
        """
        try:
            resp = await self._s3.get_object(Bucket=self.bucket, Key=okey)
        except Exception as e:
            if error_code(e) in MISS_CODES:
                return None
            raise
        total = int(resp["ContentLength"])
        async with resp["Body"] as stream:
            head = bytearray(HEADER_LEN)
            await _read_exact(stream, memoryview(head), key)
            header = unpack_header(head)
            if header.header_len > HEADER_LEN:
                await _read_exact(stream, memoryview(bytearray(header.header_len - HEADER_LEN)), key)
            n = total - header.header_len
            if n != header.payload_len:
                raise CorruptBlockError(f"{key}: object holds {n} payload bytes, header says {header.payload_len}")
            if n > view.nbytes:
                raise ValueError(f"{key}: block is {n} bytes, buffer has {view.nbytes}")
            await _read_exact(stream, view[:n], key)
        if n >= OFFLOOP_BYTES:
            await asyncio.to_thread(verify, key, header, view[:n])
        else:
            verify(key, header, view[:n])
        return n

    def close(self) -> None:
        pass  # the tier owns (and closes) the aiobotocore client
