"""Fleet-wide recency for one daemon: its hits go to this node's access logs in the bucket
(:mod:`kvbm.fleet.recency`, read by purge and prewarm), and with ``daemon.prewarm_hottest`` it joins warm: the
fleet's most recently used blocks are pulled in before ``/readyz`` says ready."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvbm.config import DaemonConfig
from kvbm.daemon.logs import logj
from kvbm.errors import KvbmError
from kvbm.fleet.recency import AccessRecorder
from kvbm.manager.core import BlockManager


class Warmth:
    """The access recorder and the join-warm prewarm; ``prewarm`` is off | running | done | failed: <why>."""

    def __init__(self, dc: DaemonConfig, manager: BlockManager, spawn: Callable[[Any], asyncio.Task[Any]]) -> None:
        self.dc = dc
        self.manager = manager
        self._spawn = spawn
        self.access_log: AccessRecorder | None = None
        self.prewarm = "off"

    def start(self) -> None:
        s3 = next((t for t in self.manager.tiers if t.kind == "s3"), None)
        if s3 is None:
            return
        if self.dc.access_log_interval_s > 0:
            self.access_log = AccessRecorder(s3, self.dc.node_id, self.dc.access_log_interval_s)
            self.manager.registry.hit_listeners.append(self.access_log.record)
            self._spawn(self.access_log.run())
        if self.dc.prewarm_hottest > 0:
            self.prewarm = "running"
            self._spawn(self._prewarm_hottest(s3.name))

    async def _prewarm_hottest(self, s3_name: str) -> None:
        from kvbm.ops.prewarm import prewarm_manager

        t0 = time.perf_counter()
        try:
            res = await prewarm_manager(self.manager, self.manager.by_name[s3_name], self.dc.prewarm_namespaces,
                                        self.dc.prewarm_hottest, self.dc.prewarm_to)
        except (KvbmError, OSError) as e:  # ready anyway: a cold node serves, a node that never gets ready does not
            self.prewarm = f"failed: {e}"
            logj("prewarm.failed", level=logging.WARNING, error=str(e))
            return
        self.prewarm = "done"
        logj("prewarm.done", seconds=round(time.perf_counter() - t0, 3), to=self.dc.prewarm_to, **res)

    async def close(self) -> None:
        """Write the last interval's hits, so a restart does not forget them."""
        if self.access_log is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.access_log.flush(), 5.0)
