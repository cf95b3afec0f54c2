"""Malformed and hostile membership objects in the bucket (issue 37, D9): anyone who can write the bucket prefix
can put one there, and none of them may stop a daemon announcing itself or following the real members.

Real parts: ``kvbm serve`` subprocesses sharing the session's SeaweedFS (tests/conftest.py), the objects PUT with
a plain S3 client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from test_discovery import FAST, connected_to, followed
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


class PlainListener:
    """A ZeroMQ PUB socket asking for PLAIN (as a daemon with tenants and no CURVE does), its ZAP handler recording
    every password a subscriber presents: what a forged membership's endpoint would harvest."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.bind("inproc://zeromq.zap.01")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.plain_server = True
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.passwords: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.zap.poll(100):
                continue
            version, rid, _domain, _addr, _ident, mechanism, *creds = self.zap.recv_multipart()
            if mechanism == b"PLAIN":
                self.passwords.append(creds[1])
            self.zap.send_multipart([version, rid, b"400", b"no", b"", b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(0)
        self.zap.close(0)
        self.ctx.term()


@pytest.fixture
def listeners() -> Iterator[list[PlainListener]]:
    made: list[PlainListener] = []
    yield made
    for one in made:
        one.close()


def test_a_forged_plain_member_is_not_sent_the_peer_token(tmp_path, s3_server, s3_prefix, nodes, listeners):
    """Two memberships announce ``events_auth: plain``: ``listed`` at an endpoint in A's daemon.peer_token_endpoints,
    ``forged`` at one that is not. A sends its peer token to the listed one only; its status says why it withheld
    it from the other."""
    token_file = tmp_path / "peer.token"
    token_file.write_text("fleet-secret-token\n")
    forged, listed = PlainListener(), PlainListener()
    listeners.extend([forged, listed])
    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", peer_token_file=str(token_file),
             peer_token_endpoints=[listed.endpoint], **FAST)
    nodes.append(a.start())
    put_members(s3_server, s3_prefix, {
        "forged": member("forged", events_endpoint=forged.endpoint, events_auth="plain"),
        "listed": member("listed", events_endpoint=listed.endpoint, events_auth="plain"),
    })
    with a.client() as ca:
        assert poll(lambda: listed.passwords and (followed(a, ca).get("forged") or {}).get("error")), \
            followed(a, ca)
        assert listed.passwords[0] == b"fleet-secret-token"
        assert forged.passwords == [], "the forged member harvested the peer token"
        assert "daemon.peer_token_endpoints" in followed(a, ca)["forged"]["error"], followed(a, ca)["forged"]


def test_a_static_peer_without_tenants_is_followed_beside_one_with(tmp_path, s3_server, s3_prefix, nodes):
    """A follows B (tenants, no CURVE: PLAIN) and C (no tenants: NULL) as configured peers, with B's admin token in
    daemon.peer_token_file. Sent to both, C refuses it and A's status says to list only B in
    daemon.peer_token_endpoints (was: 'another security mechanism (CURVE on one side only?)'); listed so, A follows
    both."""
    tenant = [{"name": "team", "token_file": str(tmp_path / "team.token"), "models": ["other/*"]}]
    b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", tenants=tenant, probe=False, prefetch=False)
    c = Node(tmp_path, "c", s3_server, s3_prefix, node_id="c", probe=False, prefetch=False)
    nodes.extend([b.start(), c.start()])
    token = str(b.proc.admin_token_path)
    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", peers=[b.events, c.events], peer_token_file=token,
             probe=False, prefetch=False)
    nodes.append(a.start())
    with a.client() as ca:
        peer = poll(lambda: followed(a, ca)[c.events].get("error") and followed(a, ca)[c.events])
        assert peer and "daemon.peer_token_endpoints" in peer["error"], followed(a, ca)
    a.stop()
    a2 = Node(tmp_path, "a2", s3_server, s3_prefix, node_id="a2", peers=[b.events, c.events], peer_token_file=token,
              peer_token_endpoints=[b.events], probe=False, prefetch=False)
    nodes.append(a2.start())
    with a2.client() as ca:
        assert poll(lambda: all(followed(a2, ca)[ep]["connected"] for ep in (b.events, c.events))), followed(a2, ca)
