"""Discovery without a peer list: daemons announce themselves in the shared bucket (``_members/``) and follow
each other; a node that joins is followed (its blocks found through its events), one that stops is dropped."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import zmq
from click.testing import CliRunner
from needs import needs
from test_fleet import Node, loads_exact, poll, prompt, store

from kvbm.cli.main import main
from kvbm.config import S3Config, load_config
from kvbm.errors import ConfigError
from kvbm.fleet.members import decode_member, members_prefix
from kvbm.tiers.s3 import make_s3_tier

FAST = {"discovery": True, "discovery_interval_s": 0.2, "discovery_ttl_s": 3.0, "probe": False, "prefetch": False}


def followed(node: Node, c) -> dict[str, dict]:
    """The peers ``node``'s daemon follows, by node id (static peers under their endpoint)."""
    return {p.get("node_id") or p["endpoint"]: p for p in c.stats()["daemon"]["fleet"]["peers"]}


def connected_to(c, names: set[str]) -> bool:
    got = {p.get("node_id") for p in c.stats()["daemon"]["fleet"]["peers"] if p["connected"]}
    return got == names


def bucket_members(srv, prefix: str) -> dict[str, dict]:
    async def go() -> dict[str, dict]:
        t = make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))
        await t.start()
        try:
            out = {}
            async for page in t.list_pages(members_prefix(prefix)):
                for _bk, okey, _size, _mt in page:
                    body = await t.get_aux(okey)
                    m = decode_member(body) if body else None
                    if m is not None:
                        out[m.node_id] = json.loads(body)
            return out
        finally:
            await t.close()

    return asyncio.run(go())


def test_nodes_find_each_other_in_the_bucket_join_and_leave(tmp_path, s3_server, s3_prefix, nodes):
    """No static lists: A and B follow each other; C joins and is followed by both (its stores reach them by
    events alone: probes are off); C stops cleanly and is dropped (its membership withdrawn); B is killed and
    dropped once its membership expires. A also lists B statically: followed once, not twice."""
    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", **FAST)
    b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", **FAST)
    a.cfg["daemon"]["peers"] = [b.events]
    nodes.extend([a.start(), b.start()])
    with a.client() as ca, b.client() as cb:
        assert poll(lambda: connected_to(ca, {"b"}) and connected_to(cb, {"a"}))
        assert len(ca.stats()["daemon"]["fleet"]["peers"]) == 1  # the static entry and the member are one
        c = Node(tmp_path, "c", s3_server, s3_prefix, node_id="c", **FAST)
        nodes.append(c.start())
        assert poll(lambda: connected_to(ca, {"b", "c"}) and connected_to(cb, {"a", "c"}))
        assert set(bucket_members(s3_server, s3_prefix)) == {"a", "b", "c"}
        keys = prompt(3)
        with c.client() as cc:
            store(cc, keys)
            assert poll(lambda: connected_to(cc, {"a", "b"}))
        for cl in (ca, cb):
            assert poll(lambda cl=cl: cl.lookup(keys).matched == 3)  # only C's events can tell them: no probes
            assert loads_exact(cl, keys) == 3
        assert followed(a, ca)["c"]["stored"] >= 3 and followed(b, cb)["c"]["stored"] >= 3
        c.stop()
        assert poll(lambda: "c" not in followed(a, ca) and "c" not in followed(b, cb))
        assert set(bucket_members(s3_server, s3_prefix)) == {"a", "b"}
        disc = ca.stats()["daemon"]["fleet"]["discovery"]
        assert disc["joined"] >= 2 and disc["left"] >= 1 and disc["members"] == ["b"]
    b.proc.kill9()  # no withdrawal: A drops B when its membership expires (TTL 3 s)
    with a.client() as ca:
        assert poll(lambda: ca.stats()["daemon"]["fleet"]["discovery"]["members"] == [])
        # the static entry for B stays (it is configured), the discovered one is gone
        peers = ca.stats()["daemon"]["fleet"]["peers"]
        assert [p["endpoint"] for p in peers] == [b.events] and peers[0]["node_id"] == ""
    env = {"KVBM_CONFIG": str(a.proc.cfg_path)}
    text = CliRunner().invoke(main, ["status"], env=env, catch_exceptions=False).output
    assert f"discovery: node a announced as {a.events}; 0 members (none)" in text


def test_discovery_config_is_validated(tmp_path):
    good = {"daemon": {"discovery": True, "node_id": "n1"}}
    path = tmp_path / "k.yaml"
    path.write_text(json.dumps(good))
    assert load_config(path, environ={}).daemon.discovery
    cfg = load_config(path, environ={"KVBM_DAEMON_DISCOVERY_TTL_S": "30", "KVBM_DAEMON_ANNOUNCE_ENDPOINT":
                                     "tcp://node-1.example:5558"})
    assert cfg.daemon.discovery_ttl_s == 30 and cfg.daemon.announce_endpoint == "tcp://node-1.example:5558"
    for daemon, field in [({"events_endpoint": ""}, "daemon.discovery: needs daemon.events_endpoint"),
                          ({"discovery_ttl_s": 1.0, "discovery_interval_s": 2.0}, "daemon.discovery_ttl_s"),
                          ({"discovery_interval_s": 0}, "daemon.discovery_interval_s"),
                          ({"announce_endpoint": "node-1:5558"}, "daemon.announce_endpoint")]:
        path.write_text(json.dumps({"daemon": {**good["daemon"], **daemon}}))
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_config(path, environ={})
    path.write_text(json.dumps({"daemon": {"discovery": "sometimes"}}))
    with pytest.raises(ConfigError, match=re.escape("daemon.discovery")):
        load_config(path, environ={})
    path.write_text(json.dumps({"s3": {"enabled": False}, **good}))
    with pytest.raises(ConfigError, match=re.escape("needs s3.enabled")):
        load_config(path, environ={})


@needs("curve", zmq.has("curve"), "libzmq without CURVE")
def test_members_with_their_own_curve_keys_are_followed_by_the_announced_key(tmp_path, s3_server, s3_prefix, nodes):
    """Each daemon has its own CURVE key pair (no shared fleet key, no peer_curve_server_key): a follower can
    only complete the handshake with the public key the member announced in the bucket."""

    def own_keys() -> dict:
        pub, sec = (k.decode() for k in zmq.curve_keypair())
        return {"curve_public_key": pub, "curve_secret_key": sec, "curve_allow_any_client": True}

    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", **FAST, **own_keys())
    b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", **FAST, **own_keys())
    nodes.extend([a.start(), b.start()])
    keys = prompt(2)
    with a.client() as ca, b.client() as cb:
        assert poll(lambda: connected_to(ca, {"b"}) and connected_to(cb, {"a"}))
        assert bucket_members(s3_server, s3_prefix)["a"]["curve_public_key"] == a.cfg["daemon"]["curve_public_key"]
        store(ca, keys)
        assert poll(lambda: cb.lookup(keys).matched == 2)  # by A's encrypted events: probes are off
        assert loads_exact(cb, keys) == 2


def test_another_hosts_host_local_endpoint_is_not_followed(tmp_path, s3_server, s3_prefix, nodes):
    """B announces its events on ``ipc://`` (no announce_endpoint): it warns that other hosts cannot follow it, and
    A, on the same host, follows it all the same. A membership as a daemon on *another* host writes it, naming the
    same ipc path ("far"), would have A connect to B's socket here and show "far" joined: A does not follow it,
    lists it as unreachable, and `kvbm status` says so."""
    import time

    import msgspec

    from kvbm.fleet.members import member_key

    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", **FAST)
    b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", **FAST)
    b.events = b.cfg["daemon"]["events_endpoint"] = f"ipc://{b.dir}/ev.sock"
    nodes.extend([a.start(), b.start()])
    far = {"v": 1, "node_id": "far", "instance": "f" * 16, "events_endpoint": b.events, "curve_public_key": "",
           "started_at": time.time(), "ttl_s": 3600.0, "host": "elsewhere.example/0f0f"}  # another host's bytes

    async def announce_far() -> None:
        t = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix), s3_server.endpoint,
                         (s3_server.access_key, s3_server.secret_key))
        await t.start()
        try:
            await t.put_aux(member_key(s3_prefix, "far"), msgspec.json.encode(far))
        finally:
            await t.close()

    asyncio.run(announce_far())
    with a.client() as ca:
        assert poll(lambda: connected_to(ca, {"b"}))  # same host: its ipc socket is reachable
        scans = ca.stats()["daemon"]["fleet"]["discovery"]["scans"]
        assert poll(lambda: ca.stats()["daemon"]["fleet"]["discovery"]["scans"] >= scans + 3)  # far was seen
        assert "far" not in followed(a, ca), followed(a, ca)["far"]
        disc = ca.stats()["daemon"]["fleet"]["discovery"]
        assert "elsewhere.example" in disc["unreachable_members"]["far"] and disc["members"] == ["b"], disc
    env = {"KVBM_CONFIG": str(a.proc.cfg_path)}
    text = CliRunner().invoke(main, ["status"], env=env, catch_exceptions=False).output
    assert "member far NOT FOLLOWED" in text, text
    assert "127.0.0.1 is a loopback address: other hosts will not follow this daemon" in text, text
    assert '"fleet.announce_local"' in b.proc.log_path.read_text()  # B warned of its ipc:// announcement


def test_peers_authenticate_to_a_daemon_with_tenants_and_no_curve(tmp_path, s3_server, s3_prefix, nodes):
    """B has tenants and no CURVE: its events socket lets only its admin token subscribe (PLAIN). A follower
    without a credential fails the handshake, and A's `kvbm status` says why (before: it reconnected forever
    without a word). With daemon.peer_token_file holding B's admin token, a configured peer (C) and a discovered
    member (D, told by B's membership that it asks for PLAIN) both follow B and learn its stores by events alone."""
    tenant = [{"name": "team", "token_file": str(tmp_path / "team.token"), "models": ["other/*"]}]
    b = Node(tmp_path, "b", s3_server, s3_prefix, node_id="b", tenants=tenant, **FAST)
    nodes.append(b.start())
    a = Node(tmp_path, "a", s3_server, s3_prefix, node_id="a", peers=[b.events], probe=False, prefetch=False)
    nodes.append(a.start())
    with a.client() as ca:
        peer = poll(lambda: (p := followed(a, ca)[b.events]).get("error") and p)
        assert peer and not peer["connected"] and "daemon.peer_token_file" in peer["error"], followed(a, ca)
    text = CliRunner().invoke(main, ["status"], env={"KVBM_CONFIG": str(a.proc.cfg_path)},
                              catch_exceptions=False).output
    assert f"peer {b.events}: FOLLOW FAILING" in text and "daemon.peer_token_file" in text, text
    a.stop()

    token = str(b.proc.admin_token_path)
    c = Node(tmp_path, "c", s3_server, s3_prefix, node_id="c", peers=[b.events], peer_token_file=token,
             probe=False, prefetch=False)
    d = Node(tmp_path, "d", s3_server, s3_prefix, node_id="d", peer_token_file=token, peer_token_endpoints=[b.events],
             **FAST)
    nodes.extend([c.start(), d.start()])
    keys = prompt(3)
    with c.client() as cc, d.client() as cd:
        assert poll(lambda: followed(c, cc)[b.events]["connected"]), followed(c, cc)
        assert poll(lambda: connected_to(cd, {"b"})), followed(d, cd)
        with b.client(admin=True) as cb:
            store(cb, keys)
        for cl in (cc, cd):
            assert poll(lambda cl=cl: cl.lookup(keys).matched == 3)  # by B's events: probes are off
        assert followed(c, cc)[b.events]["error"] == "" and followed(d, cd)["b"]["stored"] >= 3
