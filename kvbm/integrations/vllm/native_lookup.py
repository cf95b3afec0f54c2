"""The kvbm tier's lookups: which keys of vLLM's per-request batch the daemon holds, key by key.

vLLM's ``AsyncLookupManager`` hands its thread one batch per request per step, in the order the scheduler asked
(``OffloadingConnectorScheduler._lookup_complete_chunks``): every full-attention group's keys in prefix order,
then every sliding-window group's keys from the end backwards, then any partial-tail boundary keys. The
daemon's ``Lookup`` answers the leading run it holds of the hashes it is given, so the batch is first put back
into prefix order, one run per KV-cache group (the token position the scheduler recorded for each key,
``ReqContext.get_offload_key_position``), and each run is asked on its own: the run's first unheld key ends an
answer, and the keys after it are asked again (the window a sliding-window group needs may follow chunks the
daemon does not hold). Each round sends one Lookup per unfinished run, all pipelined; at most
:data:`LOOKUP_ROUNDS` rounds per batch; keys still unanswered then (or when the daemon answers ``busy``) are
misses (vLLM computes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvbm import protocol as p
from kvbm.client.lease import is_load
from kvbm.integrations.vllm.link import LINK_ERRORS, Link
from kvbm.integrations.vllm.native_keys import kvbm_hash

# Rounds of Lookups per batch at most: each unheld key with keys after it in its run costs its run one more.
LOOKUP_ROUNDS = 8


def prefix_runs(keys: Sequence[OffloadKey], req_context: ReqContext) -> list[list[int]]:
    """Indices of ``keys`` as runs in prefix order: one per KV-cache group (the key's last 4 bytes), ordered by
    the token position vLLM's scheduler recorded; keys without a position form a last run, in vLLM's order."""
    groups: dict[bytes, list[tuple[int, int]]] = {}
    loose: list[int] = []
    for i, key in enumerate(keys):
        pos = req_context.get_offload_key_position(key)
        if pos is None:
            loose.append(i)
        else:
            groups.setdefault(bytes(key[-4:]), []).append((pos, i))
    runs = [[i for _, i in sorted(g)] for g in groups.values()]
    return [*runs, loose] if loose else runs


def held_keys(client: Any, hashes: Sequence[bytes], runs: list[list[int]], rounds: int = LOOKUP_ROUNDS) -> list[bool]:
    """Whether the daemon holds each of ``hashes``, asked run by run (see the module docstring)."""
    out = [False] * len(hashes)
    todo = [r for r in runs if r]
    for _ in range(rounds):
        if not todo:
            break
        sent = []
        for run in todo:
            part = run[: p.MAX_BATCH]
            sent.append((run, part, client.begin(p.Lookup(namespace=client.namespace,
                                                          hashes=[hashes[i] for i in part]))))
        todo = []
        loaded = False
        for run, part, msg in sent:
            try:
                matched = client.finish(msg, p.LookupReply).matched
            except LINK_ERRORS as e:
                if not is_load(e):
                    raise  # the session is going down: the other replies are never read
                loaded = True  # the daemon is loaded (busy): the other replies are read, then no more rounds
                continue
            for i in part[:matched]:
                out[i] = True
            # The first unheld key (if the answer stopped short) is a miss; the run goes on after it.
            rest = run[matched + 1 :] if matched < len(part) else run[matched:]
            if rest and not loaded:
                todo.append(rest)
        if loaded:
            break
    return out


class Lookups(AsyncLookupManager):
    """vLLM's async lookup manager; its thread asks the daemon over its own link."""

    def __init__(self, link: Link, tier_type: str) -> None:
        self._link = link  # before super().__init__: that starts the thread
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        client = self._link.get()  # reconnects (on its backoff) from this thread, never the scheduler's
        if client is None:
            return [False] * len(keys)
        try:
            return held_keys(client, [kvbm_hash(k) for k in keys], prefix_runs(keys, req_context))
        except LINK_ERRORS as e:
            self._link.error(e)
            return [False] * len(keys)
