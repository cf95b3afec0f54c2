"""The G2 pools a worker's synchronous loads copy out of, across daemon restarts.

A synchronous load copies out of the slots the scheduler pinned, in the pool of the pinning daemon's generation.
The engine thread's own session maps the pool it met at start-up; after a restart the loader's thread maps the new
one (a session registering, a round trip: never on the engine's thread) and the engine's thread takes it, and
releases the pools whose daemon went: it alone copies out of them, between its steps' copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbm.integrations.vllm.link import Link
from kvbm.tiers.host import HostTier

log = logging.getLogger("kvbm.vllm")

MAP_RETRY_S = 1.0  # a pool that could not be mapped (a daemon gone again) is tried again this often at most


class PoolMaps:
    """The engine's thread's mappings of daemons' pools (``link``: its session), those the loader's thread mapped
    (``async_link``: its session; ``submit``: a call on that thread)."""

    def __init__(self, link: Link, async_link: Link, submit: Callable[..., Any]) -> None:
        self._link, self._async_link, self._submit = link, async_link, submit
        self._maps: dict[str, HostTier] = {}  # (the engine's thread) the newest daemon's pool, once mapped
        self._fresh: tuple[str, HostTier] | None = None  # mapped on the loader's thread, not taken yet
        self._lock = threading.Lock()
        self._gone: set[str] = set()  # generations whose daemon the loader's thread saw go (their maps released)
        self._mapping: dict[str, float] = {}  # generations the loader's thread was asked to map, and when

    def mapped(self) -> list[HostTier]:
        """(The engine's thread.) The pools mapped for it since a restart."""
        return list(self._maps.values())

    def pool_of(self, generation: str) -> HostTier | None:
        """(The engine's thread.) This process's mapping of the pool of ``generation`` (no round trip); None, and
        mapped on the loader's thread for the next loads, when it has none yet."""
        client = self._link.client  # the engine thread's own session, mapped at start-up
        if client is not None and client.generation == generation and client.g2 is not None:
            return client.g2
        with self._lock:  # what the loader's thread mapped since: only this thread unmaps (it copies)
            fresh, self._fresh = self._fresh, None
        if fresh is not None:
            for old in self._maps.values():
                self._submit(old.release)  # an earlier daemon's pool: its memory goes with the last mapping
            self._maps = {fresh[0]: fresh[1]}
        g2 = self._maps.get(generation)
        if g2 is not None and client is not None:
            # Its session and mapping are an earlier daemon's: let that pool's memory go (not on this thread: a big
            # pool's unmapping takes milliseconds or more; nothing here copies out of it again).
            taken = self._link.take()
            if taken is not None:
                self._submit(taken.abandon, self._link.unregister)
        now = time.monotonic()
        if g2 is None and now - self._mapping.get(generation, -MAP_RETRY_S) >= MAP_RETRY_S:
            self._mapping[generation] = now
            self._submit(self._map, generation)
        return g2

    def _map(self, generation: str) -> None:
        """(The loader's thread.) Map the pool of ``generation``: its session registers again if it is another's."""
        try:
            client = self._async_link.get()
            if client is not None and client.generation != generation:
                self._async_link.close()  # registered with an earlier daemon: register with this one
                client = self._async_link.get()
            if client is not None and client.generation == generation and client.registered is not None:
                reg = client.registered
                tier = HostTier.attach(reg.shm_name, reg.capacity_bytes, reg.slot_bytes)
                with self._lock:
                    stale, self._fresh = self._fresh, (generation, tier)
                if stale is not None:
                    stale[1].release()  # never handed to the engine's thread
        except Exception as e:
            log.warning("kvbm: mapping G2 pool %s failed: %s", generation, e)

    def release_gone(self) -> None:
        """(The engine's thread, between its copies.) Let the pools whose daemon the loader's thread saw go."""
        with self._lock:
            gone, self._gone = self._gone, set()
            fresh = self._fresh if self._fresh is not None and self._fresh[0] in gone else None
            if fresh is not None:
                self._fresh = None
        for g in gone:
            tier = self._maps.pop(g, None)
            if tier is not None:
                self._submit(tier.release)  # on the loader's thread: the engine's never copies out of it again
        if fresh is not None:
            self._submit(fresh[1].release)

    def drop_session_if_lost(self) -> None:
        """(The loader's thread.) Drop its session if its daemon went (:meth:`Link.drop_if_lost`); that daemon's pool
        is then released by the engine's thread (:meth:`release_gone`)."""
        client = self._async_link.client
        generation = client.generation if client is not None else ""
        if self._async_link.drop_if_lost() and generation:
            with self._lock:
                self._gone.add(generation)
