"""Prewarm: turn a namespace, a list of hashes or token-id prompts into block keys, find what the bucket
holds, and copy it into the disk tier with bounded concurrency, or have a running daemon onboard it into its
host tier (:func:`prewarm_host`); :func:`prewarm_manager` is a daemon joining warm.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.blocks.keys import check_namespace, is_hash_hex
from kvbm.client.lease import pin_window
from kvbm.config import Config
from kvbm.errors import ConfigError, KvbmError
from kvbm.ops.inventory import Entry, Selector, iter_bucket, iter_disk, with_access
from kvbm.ops.link import DaemonLink


def keys_from_hashes_file(path: str, namespace: str) -> list[BlockKey]:
    """One hex block hash per line (blank lines and ``#`` comments skipped)."""
    check_namespace(namespace)
    out: list[BlockKey] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            s = line.split("#", 1)[0].strip().lower()
            if not s:
                continue
            if s.startswith("0x"):
                s = s[2:]
            if not is_hash_hex(s):
                raise ConfigError(f"{path}:{n}: {line.strip()[:40]!r} is not a hex block hash")
            out.append(BlockKey(namespace, bytes.fromhex(s)))
    return list(dict.fromkeys(out))


def keys_from_tokens_file(path: str, namespace: str, block_tokens: int, scheme: str = "kvbm",
                          vllm_block_size: int | None = None, salt: str | None = None,
                          lora: str | None = None) -> list[list[BlockKey]]:
    """One JSON list of token ids per line -> the chained block keys of each prompt (full blocks only)."""
    from kvbm.blocks.hashing import prefix_hashes

    check_namespace(namespace)
    if block_tokens <= 0:
        raise ConfigError("--block-tokens must be positive")
    chains: list[list[BlockKey]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                toks = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise ConfigError(f"{path}:{n}: expected a JSON list of token ids (ints)")
            try:
                hashes = prefix_hashes(toks, block_tokens, scheme=scheme, vllm_block_size=vllm_block_size,
                                       salt=salt, lora=lora)
            except ValueError as e:
                raise ConfigError(f"{path}:{n}: {e}") from None
            chains.append([BlockKey(namespace, h) for h in hashes])
    return chains


@dataclass
class PrewarmReport:
    requested: int = 0
    present: int = 0  # already in the target tier
    fetched: int = 0
    bytes: int = 0
    seconds: float = 0.0
    missing: list[BlockKey] = field(default_factory=list)  # not in the bucket (or the daemon's index)
    unreachable: int = 0  # after a missing block of a prompt (a prefix lookup can never reach them)
    failed: list[tuple[str, str]] = field(default_factory=list)
    no_room: int = 0  # skipped: the disk tier's capacity would be exceeded

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested, "already_present": self.present, "fetched": self.fetched,
            "bytes": self.bytes, "seconds": round(self.seconds, 3), "bytes_per_s": round(self.rate, 1),
            "missing": len(self.missing), "missing_keys": [str(k) for k in self.missing[:1000]],
            "unreachable_after_gap": self.unreachable, "failed": len(self.failed),
            "failures": [{"key": k, "error": e} for k, e in self.failed[:100]], "skipped_no_room": self.no_room,
        }


def rank_hottest(entries: Iterable[Entry], hottest: int | None = None, max_bytes: int | None = None) -> list[Entry]:
    """Most recently used first (last recorded access, else write time): the first ``hottest`` entries and/or
    as many as fit in ``max_bytes`` of object size."""
    ranked = sorted(entries, key=lambda e: (-e.last_used, -e.accessed, e.ref))
    if hottest is not None:
        ranked = ranked[: max(0, hottest)]
    if max_bytes is not None:
        out, total = [], 0
        for e in ranked:
            if total + e.size > max_bytes:
                break
            out.append(e)
            total += e.size
        ranked = out
    return ranked


def _rank(entries: list[Entry], times: dict[BlockKey, float], hottest: int) -> list[Entry]:
    return rank_hottest(with_access(entries, times), hottest)


async def prewarm_manager(manager: Any, tier: Any, namespaces: Sequence[str], hottest: int, to: str,
                          concurrency: int = 8) -> dict[str, Any]:
    """A daemon joining warm: bring the ``hottest`` most recently used blocks (fleet-wide, see
    :mod:`kvbm.fleet.recency`) of each namespace (default: every namespace with access logs) from the bucket
    ``tier`` into the manager's tier ``to``. The onboards count as hits, like any other use."""
    from kvbm.fleet.recency import list_logs, read_access_times

    nss = list(namespaces) or sorted({lg.namespace for lg in await list_logs(tier)})
    sem = asyncio.Semaphore(max(1, concurrency))
    out = {"namespaces": len(nss), "requested": 0, "prewarmed": 0}

    async def one(key: BlockKey) -> None:
        async with sem:
            n = await manager.onboard([key], to=to)
        out["prewarmed"] += n  # not "+= await": concurrent onboards would lose counts

    for ns in nss:
        await manager.index_tier(tier.name, ns)  # the manager must know what the bucket holds
        entries = [e async for e in iter_bucket(tier, Selector(namespaces=(ns,), shard_chars=tier.shard_chars))]
        times, _logs = await read_access_times(tier, [ns])
        ranked = await asyncio.to_thread(_rank, entries, times, hottest)  # a sort of the namespace: off the loop
        out["requested"] += len(ranked)
        await asyncio.gather(*(one(e.key) for e in ranked))
    return out


def leading_runs(chains: Sequence[Sequence[BlockKey]], available: set[BlockKey],
                 report: PrewarmReport) -> list[BlockKey]:
    """For prompt chains: the blocks up to each prompt's first unavailable one (deduplicated, in order);
    records the first missing block of each prompt and counts the blocks after it."""
    out: dict[BlockKey, None] = {}
    missing: dict[BlockKey, None] = {}
    for chain in chains:
        for i, k in enumerate(chain):
            if k not in available:
                missing[k] = None
                report.unreachable += len(chain) - i - 1
                break
            out[k] = None
    report.missing = list(missing)
    return list(out)


async def prewarm_disk(cfg: Config, tier: Any, wanted: Sequence[tuple[BlockKey, int]], report: PrewarmReport,
                       concurrency: int = 8, progress: Callable[[int, int], None] | None = None) -> PrewarmReport:
    """Copy ``(key, object size)`` pairs from the bucket ``tier`` into the disk tier of ``cfg``, at most
    ``concurrency`` at a time, skipping blocks whose file already exists and stopping at the disk
    capacity. The disk tier is not started (no re-index, no temp-file sweep), so this is safe next to a
    running daemon that uses the same directory."""
    from kvbm.tiers.disk import DiskTier
    from kvbm.tiers.s3 import HEADER_LEN
    from kvbm.transfer import make_file_io

    cap = cfg.disk.capacity
    disk = DiskTier(cfg.disk_dir, cap, make_file_io(cfg.transfer), fsync=cfg.disk.fsync,
                    o_direct=cfg.disk.o_direct, io_threads=max(1, min(concurrency, 16)))
    used = sum(e.size for e in iter_disk(cfg.disk_dir))
    todo: list[tuple[BlockKey, int]] = []
    for k, size in wanted:
        if disk.path_for(k).exists():
            report.present += 1
            if progress:
                progress(1, 0)
            continue
        fp = disk.footprint(max(0, size - HEADER_LEN))
        if used + fp > cap:
            report.no_room += 1
            if progress:
                progress(1, 0)
            continue
        used += fp
        todo.append((k, size))
    sem = asyncio.Semaphore(max(1, concurrency))
    t0 = time.perf_counter()

    async def one(k: BlockKey, size: int) -> None:
        async with sem:
            buf = bytearray(max(0, size - HEADER_LEN))
            try:
                n = await tier.get_into(k, memoryview(buf))
                if n is None:
                    report.missing.append(k)
                else:
                    await disk.put(k, memoryview(buf)[:n])
                    report.fetched += 1
                    report.bytes += n
            except (KvbmError, OSError, ValueError) as e:
                report.failed.append((str(k), " ".join(str(e).split())[:200] or type(e).__name__))
            if progress:
                progress(1, report.bytes)

    try:
        await asyncio.gather(*(one(k, s) for k, s in todo))
    finally:
        report.seconds = time.perf_counter() - t0
        await disk.close()
    return report


def prewarm_host(link: DaemonLink, groups: Sequence[Sequence[BlockKey]], report: PrewarmReport, *,
                 chains: bool = False, batch: int = 64,
                 progress: Callable[[int, int], None] | None = None) -> PrewarmReport:
    """Have the daemon onboard each group into its host tier. Onboard brings up a group's leading held
    run; the first block it could not bring is recorded as missing. For independent keys the rest of the
    group is tried after it; for prompt ``chains`` the rest is unreachable by a prefix lookup and skipped."""
    t0 = time.perf_counter()
    if link.registered is not None:
        batch = min(batch, pin_window(link.registered))  # what this session may hold pinned at once
    for group in groups:
        i = 0
        while i < len(group):
            chunk = group[i : i + batch]
            ns = chunk[0].namespace
            try:
                n, nbytes = link.onboard(ns, [k.hash for k in chunk])
            except KvbmError as e:
                report.failed.extend((str(k), str(e)[:200]) for k in chunk)
                i += len(chunk)
                if progress:
                    progress(len(chunk), report.bytes)
                continue
            report.fetched += n
            report.bytes += nbytes
            if n < len(chunk):
                report.missing.append(chunk[n])
                if chains:
                    report.unreachable += len(group) - (i + n) - 1
                    if progress:
                        progress(len(group) - i, report.bytes)
                    break
                n += 1
            i += n
            if progress:
                progress(n, report.bytes)
    report.seconds = time.perf_counter() - t0
    return report
