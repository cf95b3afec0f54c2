"""Fresh namespaces (issue 37, D7): the first listing of a namespace in the bucket no longer walks every block the
index holds in one event-loop turn, and the scopes remembered as reconciled stay bounded however many namespaces
are minted. Real parts: a BlockManager in this process over a real G2, a G3 on real files, and G4 on SeaweedFS."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import kvbm.manager.scopes as scopes
from kvbm.blocks import BlockKey
from kvbm.config import S3Config, TransferConfig
from kvbm.manager.core import BlockManager
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.host import HostTier
from kvbm.tiers.s3 import make_s3_tier
from kvbm.transfer import make_file_io

pytestmark = pytest.mark.s3

SLOT = 64 * 1024
LEARNED = 400_000  # G4 blocks another node stored, learned from its events (no I/O)


def test_a_fresh_namespace_listing_yields_to_requests_and_scopes_stay_bounded(s3_server, s3_prefix: str,
                                                                              tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(scopes, "MAX_RECONCILED", 4)
    s3 = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix, max_retries=0), s3_server.endpoint,
                      (s3_server.access_key, s3_server.secret_key))
    io = make_file_io(TransferConfig(backend="plain"))
    mgr = BlockManager([HostTier(16 * SLOT, SLOT), DiskTier(str(tmp_path / "disk"), 64 * SLOT, io, fsync=False),
                        s3])

    async def go() -> int:
        await mgr.start(index=("host", "disk"))
        try:
            mgr.index.learn("G4", {BlockKey("other-model", os.urandom(16)): SLOT for _ in range(LEARNED)})
            turns = 0
            done = False

            async def ticker() -> None:
                nonlocal turns
                while not done:
                    turns += 1
                    await asyncio.sleep(0)

            tick = asyncio.ensure_future(ticker())
            await mgr.index_tier("G4", "fresh-namespace-0")  # one LIST of an empty prefix, then the index passes
            done = True
            await tick
            for i in range(1, 10):
                await mgr.index_tier("G4", f"fresh-namespace-{i}")
            assert len(mgr.reconciled) <= 4
            return turns
        finally:
            await mgr.close()

    turns = asyncio.run(go())
    # The LIST itself takes a few turns; a pass over the 400 000 learned blocks that yields every 4096 adds ~100.
    assert turns >= 60, f"the event loop ran {turns} other turns while the namespace was listed and reconciled"
