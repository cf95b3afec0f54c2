"""Build the configured tiers and the block manager (and the embedded SeaweedFS) from a Config."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvbm.config import Config
from kvbm.manager.core import BlockManager
from kvbm.tiers.base import Tier

log = logging.getLogger(__name__)


class Stack:
    """Everything one process needs to manage blocks: tiers, movers, manager, embedded S3."""

    def __init__(self, cfg: Config, manager: BlockManager, embedded: Any = None):
        self.cfg = cfg
        self.manager = manager
        self.embedded = embedded

    @property
    def tiers(self) -> list[Tier]:
        return self.manager.tiers

    def describe(self) -> dict[str, Any]:
        d = self.manager.describe()
        d["transfer"] = {"memory": getattr(self.manager.mover, "name", "torch")}
        disk = self.manager.by_name.get("G3")
        if disk is not None:
            d["transfer"]["file"] = getattr(getattr(disk, "file_io", None), "name", "?")
        if self.embedded is not None:
            d["embedded_s3"] = {"endpoint": self.embedded.endpoint, "dir": str(self.embedded.dir)}
        return d

    async def close(self) -> None:
        """Close the tiers; the embedded SeaweedFS keeps running as a service (``kvbm s3 stop`` ends it)."""
        await self.manager.close()


def start_embedded_s3(cfg: Config) -> Any:
    """Reuse or start the local SeaweedFS named by ``cfg.embedded_s3`` (blocking; up to a minute)."""
    from kvbm.s3server import embedded_from_config

    return embedded_from_config(cfg.embedded_s3, bucket=cfg.s3.bucket)


async def build_stack(
    cfg: Config,
    *,
    device: bool = True,
    host_shm_name: str = "",
    start: bool = True,
    index: bool = True,
    tiers: tuple[str, ...] = ("G1", "G2", "G3", "G4"),
    wait_for_s3: bool = False,
) -> Stack:
    """Create the enabled tiers of ``cfg`` (restricted to ``tiers``) and start the manager over them.

    With ``wait_for_s3`` (the daemon) an unreachable S3 endpoint does not fail the start: G4 starts
    offline and comes online by itself when the endpoint answers (see :class:`~kvbm.tiers.s3.S3Tier`).
    """
    from kvbm.tiers.device import DeviceTier
    from kvbm.tiers.disk import DiskTier
    from kvbm.tiers.host import HostTier
    from kvbm.transfer import make_file_io, make_memory_mover

    slot = cfg.block_nbytes
    built: list[Tier] = []
    embedded = None
    try:
        if device and "G1" in tiers and cfg.device.enabled:
            built.append(DeviceTier(cfg.device.capacity, slot, cfg.device.device))
        if "G2" in tiers and cfg.host.enabled:
            built.append(HostTier(cfg.host.capacity, slot,
                                  host_shm_name or cfg.host.shm_name, cfg.host.pin))
        if "G3" in tiers and cfg.disk.enabled:
            built.append(DiskTier(cfg.disk_dir, cfg.disk.capacity,
                                  make_file_io(cfg.transfer), fsync=cfg.disk.fsync, o_direct=cfg.disk.o_direct,
                                  io_threads=cfg.transfer.io_threads))
        if "G4" in tiers and cfg.s3.enabled:
            from kvbm.tiers.s3 import make_s3_tier

            creds = None
            endpoint = cfg.s3.endpoint or None
            if not endpoint and cfg.embedded_s3.enabled:
                embedded = await asyncio.to_thread(start_embedded_s3, cfg)
                endpoint = embedded.endpoint
                creds = (embedded.access_key, embedded.secret_key)
            built.append(make_s3_tier(cfg.s3, endpoint, creds, wait_for_endpoint=wait_for_s3))
        # Cascades at once: below S3's own write limit, so write-through bursts wait instead of being shed.
        cascades = min(32, cfg.s3.max_pending_writes) if any(t.kind == "s3" for t in built) else 32
        manager = BlockManager(built, make_memory_mover(cfg.transfer),
                               min_hits_to_offload=cfg.disk.min_hits_to_offload, max_concurrent_cascades=cascades,
                               max_owed_blocks=cfg.s3.max_owed_blocks, eviction=cfg.policy.eviction,
                               policy_options={"age0_s": cfg.policy.age0_s, "ghost_blocks": cfg.policy.ghost_blocks})
        if start:
            await manager.start(index=index)
    except BaseException:
        for t in built:
            try:
                await t.close()
            except Exception:  # already failing; keep the first error
                log.debug("close of %s failed during build", t.name, exc_info=True)
        raise
    return Stack(cfg, manager, embedded)
