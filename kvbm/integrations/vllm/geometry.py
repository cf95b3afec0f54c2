"""How many vLLM blocks make one kvbm block, and the configuration errors about it (said once)."""

from __future__ import annotations

import logging

from kvbm.client import WorkerClient
from kvbm.errors import KvbmError

log = logging.getLogger("kvbm.vllm")

K_SETTING = "vllm_blocks_per_kvbm_block"
_warned: set[str] = set()  # configuration errors already logged by this process (scheduler and workers)


class MisconfiguredError(KvbmError):
    """The engine's blocks and the daemon's do not fit together: a setting has to change."""


def warn_once(msg: str) -> None:
    """Log a configuration error at WARNING the first time this process meets it."""
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


class Geometry:
    """How many vLLM blocks make one kvbm block (``k``): as set in the extra config, else derived from the
    daemon's block size so that ``k`` vLLM blocks fill one daemon block. Fixed once first resolved (the
    namespace depends on it); every (re)connection checks it still fits the daemon's blocks."""

    def __init__(self, vllm_block_size: int, vblock_nbytes: int, k: int | None) -> None:
        self.vllm_block_size = vllm_block_size
        self.vblock_nbytes = vblock_nbytes  # one vLLM block of one TP rank, every layer
        self.explicit = k
        self.k: int | None = k

    @property
    def known_k(self) -> int:
        """``k``, or 0 while it is not resolved against a daemon."""
        return self.k or 0

    @property
    def block_tokens(self) -> int:
        """Tokens per kvbm block (0 while ``k`` is not resolved)."""
        return self.known_k * self.vllm_block_size

    def resolve(self, slot_bytes: int | None) -> int:
        if slot_bytes is None:  # a daemon that does not say: trust an explicit k, the daemon checks it
            if self.k is None:
                raise MisconfiguredError(f"kvbm: the daemon does not report its block size; set "
                                         f"kv_connector_extra_config.{K_SETTING}")
            return self.k
        k = self.k or slot_bytes // self.vblock_nbytes
        if k < 1 or k * self.vblock_nbytes > slot_bytes:
            raise MisconfiguredError(self.mismatch(slot_bytes))
        self.k = k
        return k

    def mismatch(self, slot_bytes: int) -> str:
        k = self.k or 1
        per_token = max(1, self.vblock_nbytes // self.vllm_block_size)
        fix = (f"set the daemon's block_bytes to at least {k * self.vblock_nbytes} B, or lower vLLM's "
               f"--block-size to at most {slot_bytes // per_token // k} tokens")
        if self.explicit:
            fix += f", or lower kv_connector_extra_config.{K_SETTING} (unset derives it)"
        return (f"kvbm: {k} vLLM block(s) of {self.vblock_nbytes} B ({self.vllm_block_size} tokens x {per_token} "
                f"B/token per TP rank) do not fit the daemon's block_bytes of {slot_bytes} B: {fix}. kvbm is "
                f"off for this engine until then (vLLM recomputes).")


def daemon_block_bytes(client: WorkerClient) -> int | None:
    """The daemon's block size: its G2 slot size, from Stats (answered without registering)."""
    for tier in client.stats()["tiers"]:
        if tier.get("tier") == "G2" and tier.get("slot_bytes"):
            return int(tier["slot_bytes"])
    return None
