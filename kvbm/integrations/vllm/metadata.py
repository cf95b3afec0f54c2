"""What the scheduler side hands the worker side each step: the blocks to load and to save."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class BlockTransfer:
    """kvbm blocks of one request and, for each, the ``k`` vLLM block ids it covers."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[list[int]]
    final: bool = False  # a finished request's last save: vLLM freed its blocks, the worker stages it first
    # A load's first block: its leading vLLM blocks vLLM holds already (its own prefix-cache hit ended inside
    # the kvbm block); block_ids[0] lists only the others, copied from that far into the stored block.
    skip: int = 0
    # A load's last block: its trailing vLLM blocks not copied (a prompt ending on the block's end: vLLM computes
    # the last prompt token's block itself); block_ids[-1] lists only the leading ones.
    tail: int = 0
    # A save's blocks are partial blocks (the daemon evicts them first until hit); or, per full block, the partial
    # blocks it supersedes: the hashes of its leading vLLM blocks, the keys of any partial block of those tokens.
    partial: bool = False
    covers: list[list[bytes]] = field(default_factory=list)
    # A synchronous load's blocks as the scheduler pinned them in G2 (kvbm.integrations.vllm.pins): per storing
    # rank, (the pool's generation, each block's slot, each block's bytes), as far as they are pinned. The worker
    # copies out of those slots with no round trip to the daemon.
    pins: dict[int, tuple[str, list[int], list[int]]] = field(default_factory=dict)
    # The pins are the head of a hit longer than the pin window: the rest is brought up in the step (Onboard).
    unpinned_rest: bool = False

    def head(self, n: int) -> BlockTransfer:
        """The first ``n`` blocks of this transfer."""
        return BlockTransfer(self.req_id, self.hashes[:n], self.block_ids[:n], self.final, self.skip,
                             self.tail if n >= len(self.hashes) else 0, self.partial, self.covers[:n])

    def after(self, n: int) -> BlockTransfer:
        """This transfer's blocks from block ``n`` on."""
        return BlockTransfer(self.req_id, self.hashes[n:], self.block_ids[n:], self.final, self.skip if not n else 0,
                             self.tail, self.partial, self.covers[n:])

    def unused(self, i: int) -> int:
        """vLLM blocks of stored block ``i`` of a load that are not copied: the first block's ``skip``, the
        last one's ``tail``."""
        return (self.skip if i == 0 else 0) + (self.tail if i == len(self.hashes) - 1 else 0)

    def first_unused(self, i: int) -> int:
        """Where in stored block ``i`` the copy starts: the first block's ``skip``, else 0."""
        return self.skip if i == 0 else 0


@dataclass
class KvbmConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests vLLM preempted: their blocks may be reused now
    # Requests aborted since the last step: vLLM freed their blocks at once (kvbm does not hold an aborted
    # request's blocks), so the worker fences their saves before the forward and never reports them.
    released: list[str] = field(default_factory=list)
    # Requests that finished since the last step: vLLM freed their blocks at once too (kvbm never holds a finished
    # request's blocks: an in-process weight sync resets the cache without a step), so before the forward the
    # worker stages their saves that have not read the blocks yet, and its ``final`` saves, and never reports them.
    finished: list[str] = field(default_factory=list)
    k: int = 0  # the scheduler's vLLM blocks per kvbm block; workers refuse transfers planned with another
    weights: str = ""  # the scheduler's weights epoch tag: workers follow it before this step's transfers
    step: int = 0  # the scheduler's step: a worker names it once it copied this step's pinned loads


@dataclass
class KvbmWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler after a step: the steps whose pinned loads they copied (their pins may go)."""

    steps: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvbmWorkerMetadata):
            self.steps |= other.steps
        return self
