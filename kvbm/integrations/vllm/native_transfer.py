"""The byte-moving part of kvbm's native vLLM tier (:mod:`kvbm.integrations.vllm.native_tier`): a job's chunk rows
of vLLM's primary tier copied into the G2 slots the daemon reserved (a store) or out of the slots it onboarded into
(a load), once each way through shared memory. Runs on the tier's store and load threads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvbm import protocol as p
from kvbm.client.lease import pin_window
from kvbm.integrations.vllm.link import LINK_ERRORS, Link, is_load
from kvbm.integrations.vllm.native_keys import kvbm_hash

# Keys of one load the daemon no longer holds, skipped at most; past them the job stops (the rest recomputed).
MAX_SKIPPED = 8


@dataclass
class Done:
    """A job's outcome, from a tier thread to the scheduler thread."""

    job_id: int
    success: bool
    keys: list[OffloadKey]
    is_load: bool
    loaded_keys: list[OffloadKey] = field(default_factory=list)  # loads: the keys copied into the primary tier
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
        """Onboard the job's chunks and copy them out of their G2 slots into the chunk rows, every chunk the daemon
        still holds: a window at a time, each no more than the session may pin (:func:`pin_window`)."""
        keys, cids = list(job.keys), [int(c) for c in job.chunk_ids]
        client = link.get()
        if client is None or client.registered is None:
            return Done(job.job_id, False, keys, True)
        rows = self._rows
        assert rows is not None
        window = pin_window(client.registered)  # the session's slot budget, and never more than half of G2
        t0 = time.monotonic()
        loaded: list[int] = []
        i = skipped = 0
        try:
            while i < len(keys):
                hashes = [kvbm_hash(k) for k in keys[i : i + window]]
                rep = client.request(p.Onboard(namespace=client.namespace, hashes=hashes), p.Onboarded)
                got = 0
                try:
                    g2 = client.g2
                    assert g2 is not None
                    pool, sb = g2.pool.numpy(), g2.slot_bytes
                    for n in range(rep.count):
                        nb = rep.nbytes[n]
                        if nb != self.row_bytes:
                            break  # not a chunk of this layout (cannot be, under this namespace): stop there
                        rows[cids[i + n]][:nb] = pool[rep.slots[n] * sb : rep.slots[n] * sb + nb]
                        loaded.append(i + n)
                        got += 1
                finally:
                    if rep.count:
                        client.request(p.Release(namespace=client.namespace, hashes=hashes[: rep.count]), p.Released)
                if got < rep.count:
                    break
                if rep.count:
                    i += rep.count  # a short answer: the key after it is unheld, or the budget ended the window
                    continue
                # The first key is not held (evicted since the lookup): vLLM recomputes it; the job goes on, a
                # few such keys at most.
                skipped += 1
                if skipped > MAX_SKIPPED:
                    break
                i += 1
        except LINK_ERRORS as e:
            link.error(e)
        done = [keys[j] for j in loaded]
        return Done(job.job_id, len(done) == len(keys), keys, True, loaded_keys=done,
                    nbytes=len(done) * self.row_bytes, seconds=time.monotonic() - t0)
