"""Partial blocks in the daemon's policy (issue 40), against real parts: a daemon subprocess, its shared-memory G2,
its disk G3 (and SeaweedFS as G4). A partial block (``store(..., partial=True)``) nobody hit leaves G2 before older
full blocks; one a load hit is evicted like any block; a full block stored with ``covers`` naming it drops it from
every tier; G3's header records it, so a restarted daemon still knows it."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
from serve_proc import ServeProc, wait_until
from test_slots import LAYOUT, NB, SLOT, daemon_cfg, keys, payload

from kvbm.blocks import FLAG_PARTIAL, MIN_HEADER_LEN, BlockKey, unpack_header
from kvbm.blocks.keys import disk_relpath
from kvbm.client.lease import Onboarding
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

G2_SLOTS = 8


def half(key: BlockKey) -> np.ndarray:
    """A partial block's bytes: fewer than a full block's (as a partial block of j < k vLLM blocks)."""
    return payload(key)[: NB // 2].copy()


def tier_of(c, key: BlockKey) -> str:
    """The fastest tier holding ``key`` ("" when none does), from a Lookup (which is not a hit)."""
    rep = c.lookup([key])
    return rep.tiers[0] if rep.matched else ""


def daemon(tmp_path, eviction: str = "lru") -> ServeProc:
    # No prefetch: the tests' lookups of blocks in G3 must not bring them back up (and evict others for them).
    cfg = daemon_cfg(tmp_path, host=f"{G2_SLOTS * SLOT // 1024}KiB", prefetch=False)
    cfg["policy"] = {"eviction": eviction}
    return ServeProc(tmp_path, cfg).start()


# Under ``frequency`` the hit partial block (two references) outranks every full block (one), so the full blocks'
# order is the same as LRU's here: the never-hit partial block must still go first (it went after full 0 and 1).
@pytest.mark.parametrize("eviction", ["lru", "frequency"])
def test_never_hit_partial_blocks_leave_g2_before_older_full_blocks_and_a_hit_one_stays_like_a_full_one(
        tmp_path, eviction):
    d = daemon(tmp_path, eviction)
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="partials")
        assert c.registered.num_slots == G2_SLOTS
        full = keys(8, b"full")
        hit, cold = keys(2, b"partial")
        # G2's LRU order (oldest first): full 0..2, the partial block a load hits, the never-hit one, full 3..5.
        assert c.store(full[:3], [payload(k) for k in full[:3]]).stored == 3
        assert c.store([hit], [half(hit)], partial=True).stored == 1
        out = np.zeros(NB // 2, np.uint8)
        assert c.load([hit], [out]) == 1 and np.array_equal(out, half(hit))
        assert c.store([cold], [half(cold)], partial=True).stored == 1
        assert c.store(full[3:6], [payload(k) for k in full[3:6]]).stored == 3
        assert [tier_of(c, k) for k in [*full[:6], hit, cold]] == ["G2"] * 8
        # Two more blocks: two leave G2 (demoted to G3, where write-through put them): the never-hit partial block
        # first, then the least recently used of the others, full 0. The hit partial block and full 1 stay.
        assert c.store(full[6:], [payload(k) for k in full[6:]]).stored == 2
        assert tier_of(c, cold) == "G3"
        assert tier_of(c, full[0]) == "G3"
        assert [tier_of(c, k) for k in [hit, *full[1:]]] == ["G2"] * 8
        m = c.stats()["manager"]
        assert m["partial_evictions"] == 1 and m["partial_blocks"] == 2 and m["partial_blocks_unhit"] == 1, m
        outs = [np.zeros(NB // 2, np.uint8)]
        assert c.load([cold], outs) == 1 and np.array_equal(outs[0], half(cold))  # from G3, byte for byte
        c.close()
    finally:
        d.stop()


def test_a_full_block_stored_with_covers_drops_its_partial_block_from_every_tier(tmp_path):
    d = daemon(tmp_path)
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="supersede")
        part, other = keys(2, b"partial")
        fulls = keys(2, b"full")
        assert c.store([part], [half(part)], partial=True).stored == 1
        assert c.store([fulls[0]], [payload(fulls[0])]).stored == 1  # a full block a worker names wrongly below
        path = tmp_path / "disk" / disk_relpath(part)
        assert wait_until(path.exists, 60), "the partial block was never written through to G3"
        # The full block whose tokens begin with the partial block's: its covers name the partial block (and, as a
        # stale or wrong name, a full block and a key nobody stored: neither is dropped).
        assert c.store([fulls[1]], [payload(fulls[1])], covers=[[part, fulls[0], other]]).stored == 1
        assert wait_until(lambda: not tier_of(c, part) and not path.exists(), 60), (tier_of(c, part), path.exists())
        assert tier_of(c, fulls[1]) == "G2" and tier_of(c, fulls[0]) == "G2"
        out = np.zeros(NB, np.uint8)
        assert c.load([fulls[1]], [out]) == 1 and np.array_equal(out, payload(fulls[1]))
        m = c.stats()["manager"]
        assert m["partials_superseded"] == 1 and m["partial_blocks"] == 0, m
        c.close()
    finally:
        d.stop()


def test_a_restarted_daemon_knows_a_partial_block_from_its_g3_header(tmp_path):
    d = daemon(tmp_path)
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="restart")
        part, = keys(1, b"partial")
        full, = keys(1, b"full")
        assert c.store([part], [half(part)], partial=True).stored == 1
        path = tmp_path / "disk" / disk_relpath(part)
        assert wait_until(path.exists, 60), "the partial block was never written through to G3"
        with path.open("rb") as f:
            assert unpack_header(f.read(MIN_HEADER_LEN)).flags == FLAG_PARTIAL
        d.stop()
        d.start()
        assert tier_of(c, part) == "G3"  # the same client registers again
        assert c.stats()["manager"]["partial_blocks"] == 1
        # Known as partial, it is superseded as before the restart.
        assert c.store([full], [payload(full)], covers=[[part]]).stored == 1
        assert wait_until(lambda: not tier_of(c, part) and not path.exists(), 60), (tier_of(c, part), path.exists())
        c.close()
    finally:
        d.stop()


def in_bucket(srv, prefix: str, key: BlockKey) -> bool:
    """Whether the bucket holds ``key``'s object (asked by a client of its own, not the daemon)."""
    async def go() -> bool:
        t = make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))
        await t.start()
        try:
            return (await t.exists_many([key])).get(key) is not None  # a HEAD: the new tier's index is empty
        finally:
            await t.close()

    return asyncio.run(go())


def g4_daemon(tmp_path, srv, prefix: str) -> ServeProc:
    """:func:`daemon` with the bucket of ``srv`` under ``prefix`` as G4."""
    cfg = daemon_cfg(tmp_path, host=f"{G2_SLOTS * SLOT // 1024}KiB", prefetch=False)
    cfg["s3"] = {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
                 "secret_key": srv.secret_key}
    return ServeProc(tmp_path, cfg).start()


def test_a_superseded_partial_block_leaves_the_bucket_too(tmp_path, s3_server, s3_prefix):
    srv = s3_server
    d = g4_daemon(tmp_path, srv, s3_prefix)
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="g4")
        part, = keys(1, b"partial")
        full, = keys(1, b"full")
        assert c.store([part], [half(part)], partial=True, durable=True).durable == 1
        assert wait_until(lambda: in_bucket(srv, s3_prefix, part), 60), "the partial block never reached G4"
        assert c.store([full], [payload(full)], covers=[[part]], durable=True).durable == 1
        assert wait_until(lambda: not in_bucket(srv, s3_prefix, part), 60), "the superseded partial stayed in G4"
        assert not tier_of(c, part) and not (tmp_path / "disk" / disk_relpath(part)).exists()
        assert in_bucket(srv, s3_prefix, full)
        c.close()
    finally:
        d.stop()


def test_a_partial_block_known_only_from_the_bucket_is_still_partial_and_superseded(tmp_path, s3_server, s3_prefix):
    """A bucket's listing shows no header flags: a restart that lost G3's copy (or another node listing the bucket)
    indexed a partial block in G4 as an ordinary one, so its full block never superseded it and it stayed in the
    bucket. A block shorter than its namespace's full blocks is partial."""
    srv = s3_server
    d = g4_daemon(tmp_path, srv, s3_prefix)
    try:
        c = d.client()
        c.register(LAYOUT, worker_id="g4")
        part, other, full = keys(3, b"bucket-only")
        assert c.store([part], [half(part)], partial=True, durable=True).durable == 1
        assert c.store([other], [payload(other)], durable=True).durable == 1  # a full block of the namespace
        assert wait_until(lambda: in_bucket(srv, s3_prefix, part), 60), "the partial block never reached G4"
        d.stop()
        shutil.rmtree(tmp_path / "disk")  # G3 and G2 gone: the bucket's listing is all the restart knows
        d.start()
        assert tier_of(c, part) == "G4"  # the same client registers again
        assert c.stats()["manager"]["partial_blocks"] == 1, c.stats()["manager"]
        assert c.store([full], [payload(full)], covers=[[part]], durable=True).durable == 1
        assert wait_until(lambda: not in_bucket(srv, s3_prefix, part), 60), "the superseded partial stayed in G4"
        assert in_bucket(srv, s3_prefix, other) and in_bucket(srv, s3_prefix, full)
        c.close()
    finally:
        d.stop()


def test_a_partial_block_a_worker_is_reading_is_not_superseded_under_it(tmp_path):
    d = daemon(tmp_path)
    try:
        reader, writer = d.client(), d.client()
        reader.register(LAYOUT, worker_id="reader")
        writer.register(LAYOUT, worker_id="writer")
        part, = keys(1, b"partial")
        full, = keys(1, b"full")
        assert writer.store([part], [half(part)], partial=True).stored == 1
        with Onboarding(reader, [part.hash]).loaded() as got:  # pinned in G2 for the reader until released
            assert got.count == 1
            assert writer.store([full], [payload(full)], covers=[[part]]).stored == 1
            assert wait_until(lambda: writer.stats()["manager"]["partials_kept"] == 1, 60), writer.stats()["manager"]
            assert np.array_equal(got.view(0).numpy(), half(part))
        assert tier_of(writer, part) == "G2"  # an ordinary block from now on
        assert writer.stats()["manager"]["partials_superseded"] == 0
        reader.close()
        writer.close()
    finally:
        d.stop()
