"""Malformed and hostile membership objects in the bucket (issue 37, D9): anyone who can write the bucket prefix
can put one there, and none of them may stop a daemon announcing itself or following the real members.

Real parts: ``kvbm serve`` subprocesses sharing the session's SeaweedFS (tests/conftest.py), the objects PUT with
a plain S3 client."""

from __future__ import annotations

import asyncio
import time

import msgspec
from test_discovery import FAST, connected_to
from test_fleet import Node, poll

from kvbm.config import S3Config
from kvbm.fleet.members import member_key
from kvbm.tiers.s3 import make_s3_tier


def put_members(srv, prefix: str, bodies: dict[str, bytes]) -> None:
    async def go() -> None:
        t = make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))
        await t.start()
        try:
            for node, body in bodies.items():
                await t.put_aux(member_key(prefix, node), body)
        finally:
            await t.close()

    asyncio.run(go())


def member(node: str, **over: object) -> bytes:
    m = {"v": 1, "node_id": node, "instance": "e" * 16, "events_endpoint": "tcp://127.0.0.1:9", "curve_public_key": "",
         "started_at": time.time(), "ttl_s": 3600.0, "host": "", **over}
    return msgspec.json.encode(m)


HOSTILE = {
    "stranger": member("stranger", events_endpoint="foo://x"),
    "badkey": member("badkey", curve_public_key="not-a-key"),
    "longipc": member("longipc", events_endpoint="ipc:///" + "x" * 200),
    "garbage": b"{\"v\": 1, \"node_id\": [",
    "wrongtypes": b"{\"v\": 1, \"node_id\": \"wrongtypes\", \"events_endpoint\": 5}",
}


def test_hostile_members_neither_stop_announcing_nor_following(tmp_path, s3_server, s3_prefix, nodes):
    """A runs discovery; five objects that are not memberships it could follow appear under ``_members/``. A goes
    on announcing itself (its object's refreshes keep counting), counts them bad, follows none of them, and
    follows B, started after them."""
    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", **FAST)
    nodes.append(a.start())
    put_members(s3_server, s3_prefix, HOSTILE)
    with a.client() as ca:
        def disc() -> dict:
            return ca.stats()["daemon"]["fleet"]["discovery"]

        assert poll(lambda: disc()["bad"] >= len(HOSTILE)), disc()
        announces = disc()["announces"]
        b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", **FAST)
        nodes.append(b.start())
        assert poll(lambda: connected_to(ca, {"b"})), ca.stats()["daemon"]["fleet"]
        assert poll(lambda: disc()["announces"] >= announces + 2), disc()  # TTL 3 s: refreshed every second
        assert disc()["members"] == ["b"], disc()
    assert "Traceback" not in a.proc.log_path.read_text()
