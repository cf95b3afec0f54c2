"""Peer-read parts without daemons: the fleet section's bounds, a follower's G2/G3 residency and Hello handling,
and the credential binding a Pin is checked against."""

from __future__ import annotations

import os

import pytest

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.config import TenantConfig, load_config
from kvbm.daemon.auth import Credentials
from kvbm.daemon.peer_serve import credential
from kvbm.errors import ConfigError
from kvbm.fleet import p2p
from kvbm.fleet.peers import PeerFollower


@pytest.mark.parametrize(("var", "value", "words"), [
    ("KVBM_FLEET_PEER_READ_BUDGET_MS", "-1", "fleet.peer_read_budget_ms: Expected `float` >= 0"),
    ("KVBM_FLEET_PEER_READ_MAX_INFLIGHT", "0", "fleet.peer_read_max_inflight: Expected `int` >= 1"),
    ("KVBM_FLEET_PEER_READ_LEASE_MS", "0", "fleet.peer_read_lease_ms: Expected `float` > 0"),
])
def test_fleet_bounds_are_checked_naming_the_field(var, value, words):
    with pytest.raises(ConfigError, match=words.replace("`", ".")):
        load_config(None, environ={var: value})


def test_fleet_defaults_load():
    fc = load_config(None, environ={"KVBM_FLEET_P2P": "true", "KVBM_FLEET_PEER_READ_BUDGET_MS": "50"}).fleet
    assert fc.p2p and fc.peer_read_budget_ms == 50


def _events(seq: int, *events: object) -> list[bytes]:
    return [p.EVENTS_TOPIC, seq.to_bytes(8, "big"), p.encode(p.EventBatch(ts=0.0, events=list(events)), 1 << 30)]


def test_follower_keeps_a_peers_hello_and_forgets_its_residency_when_it_restarts():
    seen: list[object] = []
    f = PeerFollower("tcp://127.0.0.1:1", None, lambda _f, b: seen.append(b), lambda _f: None)  # type: ignore[arg-type]
    k = BlockKey("ns", os.urandom(16))
    f.residency.stored("G2", [k])
    hello = p2p.Hello(node_id="a", endpoint="tcp://127.0.0.1:2", instance="one")
    f.handle([p2p.HELLO_TOPIC, p2p.encode(hello)])
    assert f.hello == hello and f.stats.p2p_endpoint == "tcp://127.0.0.1:2" and f.residency.holds(k)
    f.handle([p2p.HELLO_TOPIC, p2p.encode(p2p.Hello(node_id="a", endpoint="tcp://127.0.0.1:2", instance="two"))])
    assert not f.residency.holds(k)  # another process: its G2 is another pool
    f.handle([p2p.HELLO_TOPIC, p2p.encode(p2p.Hello(node_id="a", endpoint="x", instance="3", v=99))])
    assert f.stats.bad == 1 and f.hello is not None and f.hello.instance == "two"  # another version: not taken
    f.residency.stored("G3", [k])
    f.handle(_events(5))
    f.handle(_events(2))  # numbers start again: the peer restarted
    assert f.stats.resets == 1 and not f.residency.holds(k)


def test_residency_tracks_each_tier_apart():
    f = PeerFollower("tcp://127.0.0.1:1", None, lambda *_: None, lambda _f: None)  # type: ignore[arg-type]
    k = BlockKey("ns", os.urandom(16))
    f.residency.stored("G2", [k])
    f.residency.stored("G3", [k])
    f.residency.removed("G2", [k])  # demoted: still on its disk, which a pin stages back up
    assert f.residency.holds(k) and len(f.residency) == 1
    f.residency.removed("G3", [k])
    assert not f.residency.holds(k)


def test_a_pins_namespaces_are_those_of_the_askers_credential():
    t1 = TenantConfig(name="t1", token_file="-", namespaces=["ns-1"])
    creds = Credentials("admin-tok", [(t1, "t1-tok")])
    assert credential(creds, "admin-tok") == (True, None, "")
    assert credential(creds, "t1-tok") == (False, frozenset({"ns-1"}), "")
    assert "unknown token" in credential(creds, "nope")[2]
    assert "must present" in credential(creds, "")[2]
    assert credential(Credentials("admin-tok"), "") == (False, None, "")  # no tenants: whoever may connect
