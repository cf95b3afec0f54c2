"""``kvbm bench tiers``'s options and the block-manager config each of its paths builds a stack from."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvbm.bench.common import BenchTarget
from kvbm.config import Config

MiB = 1024 * 1024


@dataclass
class TiersOptions(BenchTarget):
    block_bytes: int = 8 * MiB
    blocks: int = 64
    repeats: int = 3
    groups: tuple[str, ...] = ("memory", "disk", "s3")
    s3_clients: tuple[str, ...] = ("aiobotocore", "nixl")
    file_io: tuple[str, ...] = ("auto",)  # transfer.backend values for G3: auto, plain, nixl
    disk_modes: tuple[str, ...] = ("direct", "buffered")  # G3 with O_DIRECT and with the page cache
    boto3_threads: int = 8
    s3_concurrency: int = 8  # s3.max_concurrency of the kvbm tier
    s3_reference: bool = True  # also time plain aiobotocore (the S3Tier's library, without kvbm)
    peer_python: str | None = None  # python of a venv with LMCache: its S3 connector runs as a peer
    peer_domain: str = "s3.kvbm.test"  # SeaweedFS -s3.domainName (the peer addresses <bucket>.<domain>)
    peer_io_threads: int = 64  # LMCache's s3_num_io_threads (its default)
    extra: dict[str, Any] = field(default_factory=dict)


def namespace() -> str:
    return f"kvbm-bench-{secrets.token_hex(8)}"


def tier_config(opts: TiersOptions, work: Path, *, backend: str = "auto", o_direct: bool = True,
            s3: dict[str, Any] | None = None, client: str = "aiobotocore", prefix: str = "kvbm") -> Config:
    cap = (opts.blocks + 1) * opts.block_bytes
    d: dict[str, Any] = {
        "block_bytes": opts.block_bytes,
        "device": {"enabled": True, "capacity": cap, "device": "auto"},
        "host": {"capacity": cap, "pin": True},
        "disk": {"dir": str(work / f"g3-{uuid.uuid4().hex[:6]}"), "capacity": 2 * cap + (64 << 20),
                 "o_direct": o_direct, "fsync": True},
        "s3": {"enabled": s3 is not None},
        "embedded_s3": {"enabled": False},
        "transfer": {"backend": backend},
    }
    if s3 is not None:
        d["s3"] = {"enabled": True, "endpoint": s3["endpoint"], "bucket": s3["bucket"], "prefix": prefix,
                   "access_key": s3["access_key"], "secret_key": s3["secret_key"], "client": client,
                   "max_concurrency": opts.s3_concurrency, "max_pending_writes": max(64, opts.blocks)}
    return msgspec.convert(d, Config)

