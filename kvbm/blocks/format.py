"""A block's identity (:class:`BlockKey`) and the on-storage block format (integrity header + payload).

Every stored block (a disk file, an S3 object) is ``header || payload``. The header names the
format version, the layout fingerprint, the block hash, the payload length and an xxh3-64 checksum
of the payload, and is itself checksummed. A block whose header or payload does not verify is
treated as a miss by every tier and is never handed back to a caller.
"""

from __future__ import annotations

import struct
import time

import msgspec
import xxhash

from kvbm.errors import CorruptBlockError

MAGIC = b"KVBM"
# 2: length-prefixed root hash (salt, LoRA) and layout fingerprint v2; blocks of version 1 are never read.
FORMAT_VERSION = 2
MAX_HASH_LEN = 32
# Header flags (a bit field every version 2 reader ignores, 0 in blocks written before them, so no new version).
FLAG_PARTIAL = 1  # a partial block (a request's tail past its last full block): a restart indexes it as one
# magic, version, header_len, flags, payload_len, payload_xxh3, created_ns, fingerprint(8), hash_len, hash(32)
_FIELDS = struct.Struct("<4sHHIQQQ8sB32s")
_HEADER_CRC = struct.Struct("<Q")
MIN_HEADER_LEN = 128
# Disk blocks use a 4 KiB header so the payload stays aligned for O_DIRECT.
ALIGNED_HEADER_LEN = 4096


class BlockKey(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A block's identity: its layout namespace and its chained prefix hash."""

    namespace: str
    hash: bytes

    @property
    def hex(self) -> str:
        return self.hash.hex()

    @property
    def fingerprint(self) -> str:
        """The layout fingerprint: the last 16 hex chars of the namespace."""
        return self.namespace.rsplit("-", 1)[-1]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.hash.hex()}"


class BlockHeader(msgspec.Struct, frozen=True):
    fingerprint: str
    hash: bytes
    payload_len: int
    checksum: int
    created_ns: int
    header_len: int
    version: int = FORMAT_VERSION
    flags: int = 0  # FLAG_* bits


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def pack_header(
    key: BlockKey,
    payload: bytes | bytearray | memoryview,
    header_len: int = MIN_HEADER_LEN,
    *,
    payload_checksum: int | None = None,
    flags: int = 0,
) -> bytes:
    """Serialize the header for ``payload`` (checksummed here unless given), padded to ``header_len``; ``flags``:
    FLAG_* bits."""
    if header_len < MIN_HEADER_LEN:
        raise ValueError(f"header_len must be >= {MIN_HEADER_LEN}")
    if len(key.hash) > MAX_HASH_LEN:
        raise ValueError(f"block hash longer than {MAX_HASH_LEN} bytes")
    fp = bytes.fromhex(key.fingerprint)
    if len(fp) != 8:
        raise ValueError(f"namespace {key.namespace!r} does not end in a 16-hex-char fingerprint")
    csum = checksum(payload) if payload_checksum is None else payload_checksum
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        header_len,
        flags,
        len(payload),
        csum,
        time.time_ns(),
        fp,
        len(key.hash),
        key.hash.ljust(MAX_HASH_LEN, b"\0"),
    )
    head = fields + _HEADER_CRC.pack(xxhash.xxh3_64_intdigest(fields))
    return head.ljust(header_len, b"\0")


def unpack_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and verify a header; raises CorruptBlockError on any mismatch."""
    need = _FIELDS.size + _HEADER_CRC.size
    if len(buf) < need:
        raise CorruptBlockError(f"header truncated: {len(buf)} < {need} bytes")
    fields = bytes(buf[: _FIELDS.size])
    (crc,) = _HEADER_CRC.unpack_from(buf, _FIELDS.size)
    if xxhash.xxh3_64_intdigest(fields) != crc:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, header_len, flags, plen, csum, created, fp, hlen, h = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unsupported block format version {version}")
    if header_len < MIN_HEADER_LEN or hlen > MAX_HASH_LEN:
        raise CorruptBlockError("header fields out of range")
    return BlockHeader(
        fingerprint=fp.hex(), hash=h[:hlen], payload_len=plen, checksum=csum,
        created_ns=created, header_len=header_len, version=version, flags=flags,
    )


def verify(
    key: BlockKey,
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    expected_len: int | None = None,
) -> None:
    """Check that ``payload`` under ``header`` is exactly block ``key``; raises CorruptBlockError."""
    if header.fingerprint != key.fingerprint:
        raise CorruptBlockError(f"{key}: layout fingerprint {header.fingerprint} != {key.fingerprint}")
    if header.hash != key.hash:
        raise CorruptBlockError(f"{key}: header names block {header.hash.hex()}")
    if len(payload) != header.payload_len:
        raise CorruptBlockError(f"{key}: payload is {len(payload)} bytes, header says {header.payload_len}")
    if expected_len is not None and header.payload_len != expected_len:
        raise CorruptBlockError(f"{key}: payload is {header.payload_len} bytes, layout needs {expected_len}")
    if checksum(payload) != header.checksum:
        raise CorruptBlockError(f"{key}: payload checksum mismatch")


def encode_block(
    key: BlockKey, payload: bytes | bytearray | memoryview, header_len: int = MIN_HEADER_LEN
) -> bytearray:
    """``header || payload`` in one new buffer (for object stores that take a single body): one copy."""
    body = bytearray(header_len + memoryview(payload).nbytes)
    encode_block_into(body, key, payload, header_len)
    return body


def encode_block_into(
    buf: bytearray, key: BlockKey, payload: bytes | bytearray | memoryview, header_len: int = MIN_HEADER_LEN
) -> memoryview:
    """Write ``header || payload`` into the start of ``buf`` (reused across blocks); returns that part."""
    view = memoryview(payload).cast("B")
    total = header_len + view.nbytes
    if len(buf) < total:
        raise ValueError(f"buffer of {len(buf)} bytes < block body of {total}")
    out = memoryview(buf)[:total]
    out[:header_len] = pack_header(key, view, header_len)
    out[header_len:] = view
    return out


def decode_block(
    key: BlockKey, body: bytes | bytearray | memoryview, expected_len: int | None = None
) -> memoryview:
    """Verify a ``header || payload`` body and return a view of the payload."""
    header = unpack_header(body)
    payload = memoryview(body)[header.header_len : header.header_len + header.payload_len]
    verify(key, header, payload, expected_len)
    return payload
