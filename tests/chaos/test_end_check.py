"""The chaos harness's end check (kvbm.chaos.runner.Harness.finish) on a real ``kvbm serve`` and SeaweedFS behind the
fault proxy: a block the bucket cannot be asked about is the check's failure (a harness error), not an acked block
lost; a block really lost is reported with what the daemon knew of it (its owed counters, journal and log lines),
so a finding that does not replay (seed 4052's) can still be read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from needs import require

from kvbm.chaos import runner
from kvbm.chaos.proxy import FaultProxy, FaultRates
from kvbm.chaos.runner import Harness, S3Target, tmpfs_available
from kvbm.chaos.schedule import Op, Schedule
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

pytestmark = pytest.mark.s3


def _target(srv) -> S3Target:
    return S3Target(srv.endpoint, srv.bucket, srv.access_key, srv.secret_key)


def _harness(srv, tmp_path: Path) -> Harness:
    require("tmpfs", *tmpfs_available())
    # Tenant c's block acked durable after the journal was deleted, as in seed 4052; S3 up, no final kill.
    sched = Schedule(seed=4052, index_bucket="lazy", final="", ops=[
        Op("journal_delete"), Op("store", "c", 1, [22], durable=True)])
    return Harness(sched, _target(srv), tmp_path)


def _before_the_end_check(h: Harness, fn) -> None:
    finish = h.finish

    def wrapped() -> None:
        fn()
        finish()

    h.finish = wrapped  # type: ignore[method-assign]


def test_a_bucket_that_cannot_be_read_is_a_harness_error_not_an_acked_block_lost(s3_server, tmp_path: Path,
                                                                              monkeypatch) -> None:
    """The end check reads the bucket through a proxy answering every request for tenant c's blocks (GET, HEAD)
    500 (a SeaweedFS too loaded to answer them; the client's start-up probe and bucket check still work). Before,
    the acked block was reported ``acked_lost`` ("missing in the bucket"); it is a harness error naming the check."""
    monkeypatch.setattr(runner, "DURABLE_WAIT_S", 3.0)
    h = _harness(s3_server, tmp_path)
    real = h.world.s3
    sick = FaultProxy(real.hostport(), seed=1)
    sick.rates = FaultRates(error500=1.0, target_has=h.world.keys("c", [22])[0].namespace)  # its blocks only

    def unreadable() -> None:
        h.world.s3 = S3Target(sick.endpoint, real.bucket, real.access_key, real.secret_key)

    _before_the_end_check(h, unreadable)
    sick.start()
    try:
        res = h.run()
    finally:
        h.world.s3 = real
        sick.stop()
    assert h.model.durable, res.trace  # the block was acked durable
    assert not [v for v in res.violations if v["invariant"] == "acked_lost"], res.violations
    assert any("could not be read for 1 acked blocks" in e for e in res.harness_errors), res.harness_errors


def test_an_acked_block_lost_is_reported_with_what_the_daemon_knew(s3_server, tmp_path: Path, monkeypatch) -> None:
    """The acked block is deleted from the bucket behind the daemon's back before the end check: ``acked_lost``,
    naming the step of its ack, with the daemon's owed-write counters and its log lines as evidence."""
    monkeypatch.setattr(runner, "DURABLE_WAIT_S", 3.0)
    h = _harness(s3_server, tmp_path)

    def drop() -> None:
        w = h.world

        async def go() -> None:
            cfg = S3Config(bucket=w.s3.bucket, prefix=w.prefix)
            t = make_s3_tier(cfg, w.s3.endpoint, (w.s3.access_key, w.s3.secret_key))
            await t.start()
            try:
                await t.delete_blocks(list(h.model.durable))
            finally:
                await t.close()

        asyncio.run(go())

    _before_the_end_check(h, drop)
    res = h.run()
    lost = [v for v in res.violations if v["invariant"] == "acked_lost"]
    assert len(lost) == 1, res.violations
    assert "acked durable at step 1" in lost[0]["detail"], lost[0]
    ev = lost[0].get("evidence", "")
    assert "manager: owed=" in ev and "daemon.started" in ev, ev
