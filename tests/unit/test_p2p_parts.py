"""Peer-read parts without daemons: the fleet section's bounds, a follower's G2/G3 residency and Hello handling,
and the credential binding a Pin is checked against."""

from __future__ import annotations

import os
import re

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


def test_a_read_goes_in_parts_of_about_part_bytes_in_order_every_block_once():
    from kvbm.daemon.peer_fetch import parts as _parts

    nbytes = [8, 8, 8, 3, 8, 8]
    mine = [(0, 10), (1, 11), (2, 12), (3, 13), (5, 15)]  # block 4 had no slot of its own: not read
    got = list(_parts(mine, nbytes, 16))
    assert got == [[(0, 10), (1, 11)], [(2, 12), (3, 13), (5, 15)]]
    assert list(_parts(mine, nbytes, 1)) == [[x] for x in mine]  # a block larger than a part is a part
    assert list(_parts([], nbytes, 16)) == []


def test_prefault_maps_a_shared_pool_changing_no_byte(tmp_path):
    import mmap

    import numpy as np

    from kvbm.transfer.peer import prefault

    n = 1 << 20
    path = tmp_path / "pool"
    path.write_bytes(bytes(range(256)) * (n // 256))
    with path.open("r+b") as f, mmap.mmap(f.fileno(), n, mmap.MAP_SHARED) as mm:
        view = np.frombuffer(mm, np.uint8)
        addr = view.ctypes.data
        ok = prefault(addr + 100, n - 100)  # not page-aligned: rounded down to the page
        kernel = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
        assert ok or kernel < (5, 14)  # MADV_POPULATE_WRITE is 5.14's
        assert bytes(view[:256]) == bytes(range(256)) and bytes(view[-256:]) == bytes(range(256))
        del view


def test_a_read_that_failed_after_its_first_read_was_posted_holds_its_own_slots_back(monkeypatch):
    """A READ that timed out or failed may still land (NIXL need not stop a posted GET when its handle goes): its own
    slots stay referenced, out of reuse, for QUARANTINE_S; a read that failed before posting any READ frees them."""
    import asyncio
    import time
    from types import SimpleNamespace

    from kvbm.daemon import peer_reads as pr
    from kvbm.manager import BlockManager
    from kvbm.tiers.host import HostTier

    mib = 1 << 20
    monkeypatch.setattr(pr, "QUARANTINE_S", 0.3, raising=False)

    class Agent:
        pool_addr = 0

        def read(self, *_a: object) -> None:
            raise OSError("NIXL READ did not finish")

    g2 = HostTier(8 * mib, mib)
    mgr = BlockManager([g2])
    reads = pr.PeerReads(load_config(None).fleet, mgr, lambda: [], "b")
    reads.agent = Agent()  # type: ignore[assignment]
    link = SimpleNamespace(remote=SimpleNamespace(pool_addr=0, slot_bytes=mib), remote_name="a")
    peer = SimpleNamespace(endpoint="tcp://a", stats=SimpleNamespace(node_id="a"), hello=None)
    pinned = p2p.Pinned(lease=1, slots=[0, 1], nbytes=[mib, mib], checksums=[0, 0], lease_ms=2000)
    ks = [BlockKey("ns-0000000000000000", bytes([i]) * 16) for i in range(2)]

    async def go() -> None:
        await mgr.start(index=False)
        free = g2.free_slots()
        assert await reads._copy(peer, link, ks, pinned, time.monotonic() + 2) == 0  # type: ignore[arg-type]
        assert reads.stats.failed == 1 and reads.stats.reading_slots == 0
        assert g2.detached_slots() == 2 and g2.free_slots() == free - 2  # out of reuse
        assert reads.stats.quarantined_slots == 2
        assert reads._cooldown[peer.endpoint] > time.monotonic()  # not asked again at once: each try holds slots
        assert not mgr.registry.holds("G2", ks[0])  # aborted: never a block
        await asyncio.sleep(0.5)
        assert reads.stats.quarantined_slots == 0 and g2.detached_slots() == 0 and g2.free_slots() == free
        # The pin already over: no READ posted, the slots are free at once.
        assert await reads._copy(peer, link, ks, pinned, time.monotonic() - 1) == 0  # type: ignore[arg-type]
        assert reads.stats.failed == 2 and reads.stats.quarantined_slots == 0 and g2.free_slots() == free
        await reads.close()
        await mgr.close()

    asyncio.run(go())


def test_a_failed_read_leaves_a_shared_link_to_the_read_still_in_nixl_and_close_waits_for_its_thread():
    """Two reads share a peer's link; one fails (no Pinned): the link is dropped, but its NIXL remote goes only when the
    other read's thread has left its READ. A close waits for a read's thread still in NIXL before the agent goes."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from kvbm.daemon import peer_reads as pr
    from kvbm.manager import BlockManager
    from kvbm.tiers.host import HostTier

    mib = 1 << 20
    in_read, go_on = threading.Event(), threading.Event()
    removed: list[bool] = []  # per remove_remote: was a READ in flight then?
    reading = [0]

    class Agent:
        pool_addr = 0

        def read(self, *_a: object) -> None:
            reading[0] += 1
            in_read.set()
            go_on.wait(10)
            reading[0] -= 1

        def remove_remote(self, _name: str) -> None:
            removed.append(reading[0] > 0)

    class FakeLink:
        endpoint, instance, remote_name = "tcp://a-p2p", "i1", "agent-a"
        remote = SimpleNamespace(pool_addr=0, slot_bytes=mib)

        def __init__(self) -> None:
            self.users, self.dropped, self.closed, self.asked, self.shut = 0, False, False, 0, False
            self.lock = asyncio.Lock()

        async def request(self, _msg: object, _timeout: float) -> p2p.Pinned:
            self.asked += 1
            if self.asked in (2,):
                raise OSError("no reply within 2 s")
            return p2p.Pinned(lease=self.asked, slots=[0], nbytes=[mib], checksums=[0], lease_ms=5000)

        def unpin(self, *_a: object) -> asyncio.Future[None]:
            return asyncio.ensure_future(asyncio.sleep(0))

        def close(self) -> None:
            self.closed = True

    g2 = HostTier(8 * mib, mib)
    mgr = BlockManager([g2])
    reads = pr.PeerReads(load_config(None).fleet, mgr, lambda: [], "b")
    reads.agent = Agent()  # type: ignore[assignment]
    reads.links.ctx = object()  # type: ignore[assignment]
    hello = SimpleNamespace(instance="i1", endpoint="tcp://a-p2p", node_id="a")
    peer = SimpleNamespace(endpoint="tcp://a-ev", hello=hello, stats=SimpleNamespace(node_id="a"))
    ks = [BlockKey("ns-0000000000000000", bytes([i]) * 16) for i in range(3)]

    async def wait_for(ev: threading.Event) -> None:
        while not ev.is_set():
            await asyncio.sleep(0.005)

    async def go() -> None:
        await mgr.start(index=False)
        link = FakeLink()
        reads.links._links[peer.endpoint] = link  # type: ignore[assignment]
        first = asyncio.ensure_future(reads._read(peer, [ks[0]]))  # type: ignore[arg-type]
        await wait_for(in_read)
        assert await reads._read(peer, [ks[1]]) == 0  # type: ignore[arg-type]  # its Pin failed: link dropped
        assert not link.closed and removed == []  # the first read is still in its READ on this link
        assert reads.stats.failed == 1 and link.dropped and peer.endpoint not in reads.links._links
        go_on.set()
        await first
        await asyncio.sleep(0.05)  # its Unpin on the way (the link kept open for it)
        await asyncio.gather(*reads.links.removals)
        assert link.closed and removed == [False]  # closed by its last user, no READ in flight
        # A close while a read's thread is in NIXL: it returns only after that thread has left.
        in_read.clear()
        go_on.clear()
        again = FakeLink()
        again.asked = 2
        reads.links._links[peer.endpoint] = again  # type: ignore[assignment]
        third = asyncio.ensure_future(reads._read(peer, [ks[2]]))  # type: ignore[arg-type]
        reads._reading[ks[2]] = third
        await wait_for(in_read)
        threading.Timer(0.3, go_on.set).start()
        t0 = time.monotonic()
        await reads.close()
        assert time.monotonic() - t0 >= 0.25 and reading[0] == 0 and again.closed and removed == [False, False]
        await mgr.close()

    asyncio.run(go())


def test_a_dropped_link_closing_late_leaves_the_remote_a_newer_link_to_the_same_peer_loaded():
    """NIXL keeps one remote per peer process: a link dropped (a failed read) and closed by its last user after a
    newer link loaded the same remote again must not remove it from under the newer one."""
    import asyncio
    from types import SimpleNamespace

    from kvbm.daemon.peer_link import Links

    removed: list[str] = []
    links = Links(2.0, "b")
    links.agent = SimpleNamespace(remove_remote=removed.append)
    class FakeLink:
        remote_name, shut = "agent-a", False

        def close(self) -> None:
            pass

    old, new = FakeLink(), FakeLink()

    async def go() -> None:
        links._remote_refs["agent-a"] = 2  # as two acquires that each loaded it leave it
        links._close(old)  # type: ignore[arg-type]
        await asyncio.gather(*links.removals)
        assert removed == []  # the newer link uses it
        links._close(new)  # type: ignore[arg-type]
        await asyncio.gather(*links.removals)
        assert removed == ["agent-a"] and "agent-a" not in links._remote_refs

    asyncio.run(go())
