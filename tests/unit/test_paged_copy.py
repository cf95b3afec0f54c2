"""The copy between G2 slot bytes and vLLM's paged KV: byte-exact for block ids in runs, scattered, with vLLM's
null block, in the CPU layout (copied by address) and a flash layout (block dim 1, copied by tensor), and counted
in the load path's stage counters."""

from __future__ import annotations

import pytest
import torch

from kvbm.integrations.vllm.groups import NULL_BLOCK, KVGroups
from kvbm.integrations.vllm.paged import PagedCache, runs
from kvbm.integrations.vllm.stages import Stages

NB = 12  # vLLM blocks in each layer's cache


def caches(flash: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (2, NB, 16, 2, 8) if flash else (NB, 2, 16, 16)  # flash: [2, blocks, ...]; CPU: [blocks, heads, ...]
    return {f"layer.{i}": torch.randn(shape, generator=g).to(dtype) for i in range(3)}


def reference(kv: dict[str, torch.Tensor], bdim: int, ids: list[int]) -> bytes:
    """The slot's bytes as the connector has always laid them out: layer after layer, block after block."""
    return b"".join(kv[name].select(bdim, b).contiguous().view(torch.uint8).numpy().tobytes()
                    for name in sorted(kv) for b in ids)


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 2, 7, 5], [4, 5, 1, 2], [11]])
def test_a_save_then_a_load_is_byte_exact_whatever_the_block_order(flash: bool, ids: list[int]) -> None:
    kv = caches(flash)
    bdim = 1 if flash else 0
    stages = Stages()
    pc = PagedCache(kv, NB, stages=stages)
    assert pc.flat is not flash  # the CPU layout goes by address, the flash one by tensor
    slot = torch.zeros(len(ids) * pc.vblock_bytes, dtype=torch.uint8)
    pc.copy(slot, ids, False)
    assert slot.numpy().tobytes() == reference(kv, bdim, ids)
    other = caches(flash)
    for t in other.values():
        t.zero_()
    back = PagedCache(other, NB, stages=stages)
    back.copy(slot, ids, True)
    for name in kv:
        for b in range(NB):
            want = kv[name].select(bdim, b) if b in ids else torch.zeros_like(kv[name].select(bdim, b))
            assert torch.equal(other[name].select(bdim, b), want), (name, b)
    c = stages.snapshot()
    assert c["copy_out_bytes"] == c["copy_in_bytes"] == len(ids) * pc.vblock_bytes
    assert c["copy_out_vblocks"] == c["copy_in_vblocks"] == len(ids) and c["copy_in_s"] > 0


def test_a_load_skips_the_null_block_of_a_sliding_window_and_a_save_refuses_it() -> None:
    kv = caches(False)
    groups = KVGroups({name: 0 for name in kv}, (64,))
    stages = Stages()
    pc = PagedCache(kv, NB, groups, stages=stages)
    ids = [NULL_BLOCK, 4, 5]
    slot = torch.full((3 * pc.vblock_bytes,), 7, dtype=torch.uint8)
    before = {name: t.clone() for name, t in kv.items()}
    pc.copy(slot, ids, True)
    for name, t in kv.items():
        assert torch.equal(t[NULL_BLOCK], before[name][NULL_BLOCK])  # the null block is never written
        assert torch.equal(t[4].view(torch.uint8), torch.full_like(t[4].view(torch.uint8), 7))
    assert stages.snapshot()["copy_in_vblocks"] == 2
    with pytest.raises(ValueError, match="null block"):
        pc.copy(slot, ids, False)


def test_a_slot_too_small_for_the_blocks_is_refused_naming_the_sizes() -> None:
    pc = PagedCache(caches(False), NB, stages=Stages())
    with pytest.raises(ValueError, match=f"cannot hold 2 vLLM blocks \\({2 * pc.vblock_bytes} B\\)"):
        pc.copy(torch.zeros(pc.vblock_bytes, dtype=torch.uint8), [1, 2], True)


def test_runs_group_consecutive_ids_and_leave_out_the_null_block() -> None:
    assert runs([3, 4, 5, 9, 10, 2], False) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([0, 1, 2], True) == [(1, 1, 2)]
    assert runs([0, 1, 2], False) == [(0, 0, 3)]
    assert runs([5, 0, 6], True) == [(0, 5, 1), (2, 6, 1)]


@pytest.mark.parametrize("flash", [False, True])
def test_part_of_a_stored_block_loads_into_its_own_vllm_blocks_only(flash: bool) -> None:
    # A full block of 4 vLLM blocks stored; vLLM already holds the first (its own prefix hit) and the last must be
    # computed (the prompt's last token): blocks 1 and 2 of the slot go to vLLM blocks 8 and 9.
    kv = caches(flash)
    bdim = 1 if flash else 0
    pc = PagedCache(kv, NB, stages=Stages())
    slot = torch.zeros(4 * pc.vblock_bytes, dtype=torch.uint8)
    pc.copy(slot, [2, 3, 4, 5], False)
    other = {name: torch.zeros_like(t) for name, t in kv.items()}
    PagedCache(other, NB, stages=Stages()).copy(slot, [8, 9], True, slot_k=4, skip=1)
    for name in kv:
        for b in range(NB):
            want = {8: kv[name].select(bdim, 3), 9: kv[name].select(bdim, 4)}.get(b)
            got = other[name].select(bdim, b)
            assert torch.equal(got, want if want is not None else torch.zeros_like(got)), (name, b)
    with pytest.raises(ValueError, match=r"vLLM blocks 3\.\.5 of a slot holding 4 per layer"):
        pc.copy(slot, [8, 9], True, slot_k=4, skip=3)
