"""``kvbm bench manager``'s options, and the keys and report rows its parts share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvbm.bench.common import BenchTarget
from kvbm.blocks import BlockKey

MiB = 1024 * 1024


@dataclass
class ManagerOptions(BenchTarget):
    registered: int = 1_000_000
    prefix_blocks: int = 1000
    lookups: int = 1000
    daemon: str = "auto"  # auto: use kvbm.daemon when it exists; off
    daemon_events: int = 50_000
    daemon_batch: int = 64
    daemon_lookups: int = 500
    daemon_registered: int | None = None  # blocks registered in the daemon before its lookups (None: registered)
    onboard_blocks: int = 32
    block_bytes: int = 8 * MiB
    onboard_repeats: int = 3
    groups: tuple[str, ...] = ("ingest", "lookup", "memory", "daemon", "onboard")


TIERS = ["G1", "G2", "G3", "G4"]


def block_keys(n: int, ns: str) -> list[BlockKey]:
    # 16-byte hashes like kvbm's BLAKE2b-128 chain hashes; os.urandom in one call is fast.
    raw = os.urandom(16 * n)
    return [BlockKey(ns, raw[i * 16 : (i + 1) * 16]) for i in range(n)]


def add_row(rows: list[dict[str, Any]], metric: str, via: str, value: float, unit: str, note: str = "",
         **extra: Any) -> None:
    rows.append({"metric": metric, "via": via, "value": value, "unit": unit, "note": note, **extra})
