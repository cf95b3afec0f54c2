"""The byte-moving part of kvbm's native vLLM tier (:mod:`kvbm.integrations.vllm.native_tier`): a job's chunk rows
of vLLM's primary tier copied into the G2 slots the daemon reserved (a store) or out of the slots it onboarded into
(a load), once each way through shared memory. Runs on the tier's store and load threads."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvbm import protocol as p
from kvbm.integrations.vllm.link import LINK_ERRORS, Link, is_load
from kvbm.integrations.vllm.native_keys import kvbm_hash


@dataclass
class Done:
    """A job's outcome, from a tier thread to the scheduler thread."""

    job_id: int
    success: bool
    keys: list[OffloadKey]
    is_load: bool
    loaded: int = 0  # loads: leading keys copied into the primary tier
    nbytes: int = 0
    seconds: float | None = None
    dropped: str = ""  # stores: why it was dropped (one of DROP_REASONS), "" if it was attempted


class ChunkRows:
    """vLLM's primary tier as numpy rows (views, no copy), one ``row_bytes`` chunk a row, and the copies between them
    and G2."""

    def __init__(self, primary_kv_view: memoryview, row_bytes: int) -> None:
        self._rows: np.ndarray | None = np.asarray(primary_kv_view).view(np.uint8)
        self.row_bytes = row_bytes

    def close(self) -> None:
        """Drop the views (vLLM may unmap its memory afterwards)."""
        self._rows = None

    def store(self, job: TransferJob, link: Link) -> Done:
        """Copy the job's chunk rows into G2 slots the daemon reserved and commit them (one Store)."""
        keys = list(job.keys)
        client = link.get()
        if client is None:
            return Done(job.job_id, False, keys, False, dropped="down")
        rows = self._rows
        assert rows is not None
        bufs = [rows[int(c)] for c in job.chunk_ids]  # views of the primary rows, copied once into G2
        t0 = time.monotonic()
        try:
            client.store([kvbm_hash(k) for k in keys], bufs)
        except LINK_ERRORS as e:
            if is_load(e):
                return Done(job.job_id, False, keys, False, dropped="shed")
            link.error(e)
            return Done(job.job_id, False, keys, False, dropped="down")
        return Done(job.job_id, True, keys, False, nbytes=len(keys) * self.row_bytes,
                     seconds=time.monotonic() - t0)

    def load(self, job: TransferJob, link: Link) -> Done:
        """Onboard the job's chunks and copy them out of their G2 slots into the chunk rows, leading run first."""
        keys, cids = list(job.keys), [int(c) for c in job.chunk_ids]
        client = link.get()
        if client is None or client.registered is None:
            return Done(job.job_id, False, keys, True)
        rows = self._rows
        assert rows is not None
        # Onboarded blocks stay pinned in G2 until released: never ask for more than half the pool at once.
        window = max(1, client.registered.num_slots // 2)
        t0 = time.monotonic()
        loaded = 0
        try:
            for a in range(0, len(keys), window):
                hashes = [kvbm_hash(k) for k in keys[a : a + window]]
                rep = client.request(p.Onboard(namespace=client.namespace, hashes=hashes), p.Onboarded)
                got = 0
                try:
                    g2 = client.g2
                    assert g2 is not None
                    pool, sb = g2.pool.numpy(), g2.slot_bytes
                    for i in range(rep.count):
                        nb = rep.nbytes[i]
                        if nb != self.row_bytes:
                            break  # not a chunk of this layout (cannot be, under this namespace): stop there
                        rows[cids[a + i]][:nb] = pool[rep.slots[i] * sb : rep.slots[i] * sb + nb]
                        got += 1
                finally:
                    if rep.count:
                        client.request(p.Release(namespace=client.namespace, hashes=hashes[: rep.count]), p.Released)
                loaded += got
                if got < len(hashes):
                    break
        except LINK_ERRORS as e:
            link.error(e)
        return Done(job.job_id, loaded == len(keys), keys, True, loaded=loaded, nbytes=loaded * self.row_bytes,
                     seconds=time.monotonic() - t0)
