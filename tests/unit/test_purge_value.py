"""``kvbm purge --max-bytes --by value``: the blocks the placement policy values least go first (issue 30)."""

from __future__ import annotations

from click.testing import CliRunner

from kvbm.blocks import BlockKey
from kvbm.cli.purge import purge
from kvbm.ops import Entry, Selector, plan_purge

NS = "tiny-llama-0123456789abcdef"


def _key(i: int) -> BlockKey:
    return BlockKey(NS, i.to_bytes(16, "big"))


def test_value_keeps_a_block_hit_since_written_over_a_newer_one_off():
    now = 100_000.0
    hit = Entry("bucket", _key(1), "hit", 100, mtime=now - 5000, accessed=now - 400)  # written, then hit
    once = Entry("bucket", _key(2), "once", 100, mtime=now - 300)  # newer, never hit
    fresh = Entry("bucket", _key(3), "fresh", 100, mtime=now - 10)
    es = [hit, once, fresh]
    sel = Selector(max_bytes=200)
    assert [e.ref for e in plan_purge(es, sel, now)] == ["hit"]  # by last access: the hit block is oldest
    # By value: 0.42 / (400 + 600) for the hit block against 0.24 / (300 + 600) for the one-off.
    assert [e.ref for e in plan_purge(es, sel, now, rank="value")] == ["once"]


def test_the_cli_takes_by_value():
    res = CliRunner().invoke(purge, ["--by", "nonsense", "--max-bytes", "1GiB", "--dry-run"])
    assert res.exit_code != 0 and "value" in res.output
