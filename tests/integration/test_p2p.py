"""Peer reads: two real daemons (``kvbm serve`` subprocesses) sharing one SeaweedFS bucket, each with its own G2;
node B reads the blocks node A holds in G2 with a one-sided NIXL (UCX) READ instead of the bucket's GET.

Covered: byte-exact blocks with no GET for them; a block whose bytes do not match the peer's checksum is a miss
(read from the bucket instead); a stopped peer costs at most the budget and, once it runs again, holds no pin; a
peer killed mid-read leaves no slot reserved on the reader; a peer refuses a namespace the asker's credential
does not cover."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from needs import require
from serve_proc import ServeProc, wait_until
from test_fleet import LAYOUT, free_port, loads_exact, payload, prompt, store

from kvbm.client import WorkerClient
from kvbm.tiers.host import shm_path
from kvbm.transfer import nixl_available

WAIT_S = 30.0  # generous deadline for poll loops; never a timing assertion


@pytest.fixture(autouse=True)
def _nixl() -> None:
    ok, why = nixl_available()
    require("nixl", ok, f"peer reads are NIXL UCX READs: {why}")


class Node:
    """One daemon: its own G2 (1 MiB of 64 KiB blocks), disk and sockets; the shared bucket and prefix."""

    def __init__(self, tmp: Path, name: str, srv: Any, prefix: str, fleet: dict[str, Any] | None = None,
                 **daemon: Any) -> None:
        self.name = name
        self.dir = tmp / name
        self.dir.mkdir()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.cfg: dict[str, Any] = {
            "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
            "disk": {"dir": str(self.dir / "disk"), "capacity": "16MiB", "fsync": False},
            "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "prefix": prefix, "access_key": srv.access_key,
                   "secret_key": srv.secret_key},
            "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"ipc://{self.dir}/d.sock", "events_endpoint": self.events, "metrics_port": 0,
                       "node_id": name, "prefetch": False, **daemon},
            "fleet": {"p2p": True, "peer_read_budget_ms": 5000, **(fleet or {})},
        }
        self.proc: ServeProc | None = None

    def start(self) -> Node:
        for attempt in range(3):
            try:
                self.proc = ServeProc(self.dir, self.cfg).start()
                return self
            except RuntimeError as e:
                # The events port was free when picked, and taken before the daemon bound it (another test's
                # process, or a NIXL agent's listener on an ephemeral port): pick another (seen once in CI).
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                self.events = self.cfg["daemon"]["events_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.proc is not None and self.proc.proc.poll() is None:
                os.kill(self.proc.proc.pid, signal.SIGCONT)
            self.proc.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.proc is not None
        return self.proc.proc.pid

    def client(self, *, admin: bool = False, keypair: tuple[bytes, bytes] | None = None) -> WorkerClient:
        assert self.proc is not None
        c = self.proc.client(admin=admin, curve_server_key=self.cfg["daemon"].get("curve_public_key", ""),
                             curve_keypair=keypair)
        c.register(LAYOUT, worker_id=f"w-{self.name}-{admin}")
        return c


def tier(c: WorkerClient, name: str) -> dict[str, Any]:
    return next(t for t in c.stats()["tiers"] if t["tier"] == name)


def p2p(c: WorkerClient) -> dict[str, Any]:
    return c.stats()["daemon"]["fleet"]["p2p"]


def peer(c: WorkerClient) -> dict[str, Any]:
    return c.stats()["daemon"]["fleet"]["peers"][0]


def pair(tmp: Path, srv: Any, prefix: str, nodes: list, *, a_daemon: dict[str, Any] | None = None,
         b_daemon: dict[str, Any] | None = None, b_fleet: dict[str, Any] | None = None,
         a_fleet: dict[str, Any] | None = None, before_b: Any = None) -> tuple[Node, Node]:
    """A (serving) and B (following A, reading from it), both up, B knowing A's peer-read socket."""
    a = Node(tmp, "a", srv, prefix, a_fleet, **(a_daemon or {}))
    nodes.append(a.start())
    if before_b is not None:
        before_b(a)
    b = Node(tmp, "b", srv, prefix, b_fleet, peers=[a.events], **(b_daemon or {}))
    nodes.append(b.start())
    return a, b


def ready(cb: WorkerClient) -> bool:
    """B follows A, knows A's peer-read socket, and has its own NIXL agent up (created after daemon.started)."""
    got = peer(cb)
    return bool(got["connected"] and got["p2p_endpoint"] and p2p(cb)["serve"] is not None)


def learned(cb: WorkerClient, n: int) -> bool:
    return peer(cb)["resident"] >= n


def p2p_log(n: Node) -> str:
    """The node's peer-read log lines (what an assertion shows when a read did not happen)."""
    return "".join(line for line in (n.dir / "daemon.log").read_text().splitlines(True) if "p2p" in line)


def corrupt_in_shm(shm_name: str, data: np.ndarray) -> None:
    """Flip a byte of ``data``'s copy in a G2 pool file (what a stray write into shared memory would do)."""
    path = shm_path(shm_name)
    raw = path.read_bytes()
    at = raw.find(data[:4096].tobytes())
    assert at >= 0, "block not found in the peer's G2 pool"
    with open(path, "r+b") as f:
        f.seek(at + 100)
        f.write(bytes([raw[at + 100] ^ 0xFF]))


# -- tests -------------------------------------------------------------------------------------------------
def test_blocks_a_peer_holds_are_read_from_its_g2_byte_exact_with_no_get(tmp_path, s3_server, s3_prefix, nodes):
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes)
    keys = prompt(6)
    with a.client() as ca, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, keys)
        assert wait_until(lambda: learned(cb, 6), WAIT_S), peer(cb)
        # A sums each block it stores in the background, so B's pin does not wait for the hashing.
        assert wait_until(lambda: p2p(ca)["serve"].get("checksums_ahead", 0) == 6, WAIT_S), p2p(ca)["serve"]
        gets = tier(cb, "G4")["stats"]["gets"]
        got = cb.lookup(keys)
        assert got.tiers == ["G2"] * 6, (got, p2p_log(b))  # read from A into B's G2 within the lookup
        assert loads_exact(cb, keys) == 6
        assert tier(cb, "G4")["stats"]["gets"] == gets  # no GET for them
        read = p2p(cb)["read"]
        assert read["blocks"] == 6 and read["bytes"] == 6 * LAYOUT.block_nbytes and read["checksum_failures"] == 0
        assert read["peers"]["a"]["blocks"] == 6 and read["reading_slots"] == 0
        assert wait_until(lambda: p2p(ca)["serve"]["pinned_slots"] == 0, WAIT_S)
        serve = p2p(ca)["serve"]
        assert serve["pins"] == 1 and serve["pinned_blocks"] == 6 and serve["unpins"] == 1 and serve["leases"] == 0
        assert (serve["checksums_known"], serve["checksums_computed"]) == (6, 0)
        # B keeps the checksums it verified the 6 blocks against: not hashed again, there for B's own peers.
        b_serve = p2p(cb)["serve"]
        assert (b_serve.get("checksums_from_reads"), b_serve["checksums_ahead"]) == (6, 0), b_serve


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process, every thread of it (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_daemons_serving_and_reading_peers_do_not_spin_a_core_when_idle(tmp_path, s3_server, s3_prefix, nodes):
    # NIXL's UCX progress thread (enable_prog_thread) polled the worker without pause: every daemon with peer
    # reads on burned a whole core while idle, taken from the engines beside it (seen: 1.0 core each, and vLLM's
    # prefill twice as slow with two such daemons on 2 cores).
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes)
    keys = prompt(4)
    with a.client() as ca, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, keys)
        assert wait_until(lambda: learned(cb, 4), WAIT_S)
        assert cb.lookup(keys).tiers == ["G2"] * 4, p2p_log(b)  # both agents met: the UCX endpoints exist
        assert loads_exact(cb, keys) == 4
        time.sleep(0.5)
        before = {n.name: cpu_seconds(n.pid) for n in (a, b)}
        time.sleep(3.0)
        used = {n.name: round((cpu_seconds(n.pid) - before[n.name]) / 3.0, 3) for n in (a, b)}
    assert max(used.values()) < 0.25, f"cores used by idle daemons: {used}"


def test_a_block_on_the_peers_disk_is_staged_to_its_g2_and_read(tmp_path, s3_server, s3_prefix, nodes):
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes)
    keys = prompt(3)
    with a.client() as ca, a.client(admin=True) as admin_a, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, keys)
        admin_a.evict(keys, tiers=["G2"])  # A keeps them on its disk (G3) and in the bucket
        assert ca.lookup(keys).tiers == ["G3"] * 3
        assert wait_until(lambda: learned(cb, 3), WAIT_S)
        gets = tier(cb, "G4")["stats"]["gets"]
        assert cb.lookup(keys).tiers == ["G2"] * 3, p2p_log(b)
        assert loads_exact(cb, keys) == 3
        assert tier(cb, "G4")["stats"]["gets"] == gets
        assert p2p(ca)["serve"]["pinned_blocks"] == 3


def test_a_block_failing_its_checksum_is_a_miss_read_from_the_bucket(tmp_path, s3_server, s3_prefix, nodes):
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes)
    keys = prompt(4)
    with a.client() as ca, b.client() as cb, b.client(admin=True) as admin_b:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, keys)
        assert wait_until(lambda: learned(cb, 4), WAIT_S)
        assert cb.lookup(keys).tiers == ["G2"] * 4  # A summed (and kept) each block's checksum after its store
        # A's copy of keys[1] changes in its shared memory; B forgets its own copies and asks A again.
        corrupt_in_shm(tier(ca, "G2")["shm_name"], payload(keys[1]))
        admin_b.evict(keys, tiers=["G2", "G3"])
        assert wait_until(lambda: p2p(ca)["serve"]["leases"] == 0, WAIT_S)
        gets = tier(cb, "G4")["stats"]["gets"]
        got = cb.lookup(keys)
        assert got.tiers == ["G2", "G4", "G2", "G2"], got  # the bad block is not taken: the bucket's copy is
        assert p2p(cb)["read"]["checksum_failures"] == 1
        assert loads_exact(cb, keys) == 4
        assert tier(cb, "G4")["stats"]["gets"] == gets + 1
        assert p2p(cb)["read"]["reading_slots"] == 0 and tier(cb, "G2")["detached_slots"] == 0


def test_a_stopped_peer_costs_the_budget_and_keeps_no_pin(tmp_path, s3_server, s3_prefix, nodes):
    budget_ms = 300
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes, b_fleet={"peer_read_budget_ms": budget_ms,
                                                                "peer_read_lease_ms": 2000})
    warm, keys, other = prompt(1), prompt(4), prompt(4)
    with a.client() as ca, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, warm)  # a first read links B to A (Connect, NIXL metadata): the Pin below reaches A's socket
        assert wait_until(lambda: learned(cb, 1), WAIT_S)
        # On a loaded machine the linking read may itself pass the 300 ms budget (answered from the bucket, the
        # read going on): asked again until it is served from B's G2; the counts below are from then on.
        assert wait_until(lambda: cb.lookup(warm).tiers == ["G2"], WAIT_S)
        r0, pins0 = p2p(cb)["read"], p2p(ca)["serve"]["pins"]
        store(ca, keys + other)
        assert wait_until(lambda: learned(cb, 9), WAIT_S)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = cb.lookup(keys)
            took = time.monotonic() - t0
            assert got.tiers == ["G4"] * 4  # answered with the bucket's copies
            # The bound the budget promises (plus room for a loaded 2-core machine), not a speed measurement.
            assert took < budget_ms / 1000 + 1.0, took
            assert p2p(cb)["read"]["late"] == r0["late"] + 1
            # While that read is stuck, other lookups do not wait on A again (one budget, not one per lookup).
            assert cb.lookup(other).tiers == ["G4"] * 4
            assert cb.lookup(keys).tiers == ["G4"] * 4
            assert p2p(cb)["read"]["reads"] == r0["reads"] + 1 and p2p(cb)["read"]["late"] == r0["late"] + 2
            assert loads_exact(cb, keys) == 4
            # The read gives up when its pin has no answer (peer_read_lease_ms): no slot of B's is held for it.
            assert wait_until(lambda: p2p(cb)["read"]["failed"] == r0["failed"] + 1, WAIT_S)
            assert p2p(cb)["read"]["reading_slots"] == 0 and tier(cb, "G2")["detached_slots"] == 0
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # A reads the stale Pin once it runs again: its pin is released (B's Unpin, else its lease deadline).
        assert wait_until(lambda: p2p(ca)["serve"]["pins"] == pins0 + 1, WAIT_S)
        assert wait_until(lambda: p2p(ca)["serve"]["pinned_slots"] == 0 and p2p(ca)["serve"]["leases"] == 0, WAIT_S)


def test_a_peer_killed_mid_read_leaves_no_slot_reserved(tmp_path, s3_server, s3_prefix, nodes):
    budget_ms = 300
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes, b_fleet={"peer_read_budget_ms": budget_ms,
                                                                "peer_read_lease_ms": 2000})
    keys = prompt(4)
    with a.client() as ca, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S)
        store(ca, keys)
        assert wait_until(lambda: learned(cb, 4), WAIT_S)
        ca.abandon()
        os.kill(a.pid, signal.SIGSTOP)  # the Pin is sent and never answered: A dies with it in flight
        t0 = time.monotonic()
        got = cb.lookup(keys)
        took = time.monotonic() - t0
        assert a.proc is not None
        a.proc.kill9()
        assert got.tiers == ["G4"] * 4 and took < budget_ms / 1000 + 1.0, (got, took)
        assert loads_exact(cb, keys) == 4
        assert wait_until(lambda: p2p(cb)["read"]["failed"] == 1, WAIT_S)
        assert p2p(cb)["read"]["reading_slots"] == 0 and tier(cb, "G2")["detached_slots"] == 0
        assert cb.stats()["daemon"]["pins"] == 0


def test_a_peer_refuses_a_namespace_the_askers_credential_does_not_cover(tmp_path, s3_server, s3_prefix, nodes):
    """A has tenants; B presents tenant t1's token, whose namespaces do not include the blocks'. A follower of a
    daemon with tenants and no CURVE subscribes with its admin token (daemon.peer_token_file)."""
    t1 = tmp_path / "t1.token"
    t1.write_text("t1-" + os.urandom(16).hex())
    t1.chmod(0o600)
    tenants = [{"name": "t1", "token_file": str(t1), "namespaces": ["someone-else"]}]
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes, a_daemon={"tenants": tenants},
                b_daemon={"peer_token_file": str(tmp_path / "a" / "admin.token")},
                b_fleet={"peer_read_token_file": str(t1)})
    keys = prompt(3)
    with a.client(admin=True) as ca, b.client() as cb:
        assert wait_until(lambda: ready(cb), WAIT_S), peer(cb)
        store(ca, keys)
        assert wait_until(lambda: learned(cb, 3), WAIT_S)
        gets = tier(cb, "G4")["stats"]["gets"]
        got = cb.lookup(keys)
        assert got.tiers == ["G4"] * 3
        assert p2p(cb)["read"]["refused"] == 1 and p2p(cb)["read"]["blocks"] == 0
        assert p2p(ca)["serve"]["refused_forbidden"] == 1 and p2p(ca)["serve"]["pins"] == 0
        assert loads_exact(cb, keys) == 3
        assert tier(cb, "G4")["stats"]["gets"] == gets + 3


def test_peer_reads_over_curve_and_the_socket_refuses_an_unlisted_key(tmp_path, s3_server, s3_prefix, nodes):
    """A fleet sharing one CURVE key pair with a client allow-list: B connects to A's peer-read socket with the
    fleet's (listed) keys and reads; a client with a key not on the list gets no answer (ZAP refuses it)."""
    import zmq

    from kvbm.fleet import p2p as m
    from kvbm.security import load_keypair, write_keypair

    pub, sec = (k.decode() for k in zmq.curve_keypair())
    allowed = tmp_path / "clients"
    allowed.mkdir()
    (allowed / "fleet.key").write_text(f'metadata\ncurve\n    public-key = "{pub}"\n')
    worker_pub, _ = write_keypair(tmp_path / "keys", "worker")
    (allowed / "worker.key").write_text(worker_pub.read_text())
    worker = load_keypair(tmp_path / "keys" / "worker.key_secret")
    keys = {"curve_public_key": pub, "curve_secret_key": sec, "curve_clients_dir": str(allowed)}
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes, a_daemon=keys, b_daemon=keys)
    blocks = prompt(3)
    with a.client(keypair=worker) as ca, b.client(keypair=worker) as cb:
        assert wait_until(lambda: ready(cb), WAIT_S), peer(cb)
        store(ca, blocks)
        assert wait_until(lambda: learned(cb, 3), WAIT_S)
        gets = tier(cb, "G4")["stats"]["gets"]
        assert cb.lookup(blocks).tiers == ["G2"] * 3, p2p_log(b)
        assert loads_exact(cb, blocks) == 3 and tier(cb, "G4")["stats"]["gets"] == gets
        ctx = zmq.Context()

        def answered(public: bytes, secret: bytes) -> bool:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = pub.encode(), public, secret
            s.connect(peer(cb)["p2p_endpoint"])
            s.send_multipart([b"\0" * 8, m.encode(m.Connect(node_id="probe", agent=b"not NIXL metadata"))])
            got = bool(s.poll(3000))
            if got:
                assert isinstance(m.decode_reply(s.recv_multipart()[1]), m.Refused)  # bad metadata: refused
            s.close(0)
            return got

        assert answered(pub.encode(), sec.encode())  # a listed key reaches the socket (here: bad metadata)
        assert not answered(*zmq.curve_keypair()), "an unlisted CURVE key was answered"
        ctx.term()
        assert p2p(ca)["serve"]["connects"] == 1  # B alone


def test_the_serving_side_caps_pins_in_flight_and_refuses_another_version(tmp_path, s3_server, s3_prefix, nodes):
    """A client speaking the peer-read protocol to A directly (a real NIXL agent's metadata): with
    peer_read_max_inflight 1 a second Pin while one is held is answered busy, and served again after Unpin."""
    import torch
    import zmq

    from kvbm.fleet import p2p as m
    from kvbm.transfer.peer import PeerAgent

    a = Node(tmp_path, "a", s3_server, s3_prefix, {"peer_read_max_inflight": 1})
    nodes.append(a.start())
    keys = prompt(2)
    with a.client() as ca:
        store(ca, keys)
        assert wait_until(lambda: p2p(ca)["serve"] is not None, WAIT_S)
        agent = PeerAgent(torch.zeros(1 << 20, dtype=torch.uint8))
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(p2p(ca)["serve"]["endpoint"])

        def ask(msg: object) -> object:
            s.send_multipart([b"\0" * 8, m.encode(msg)])
            assert s.poll(10_000), "no reply"
            return m.decode_reply(s.recv_multipart()[1])

        try:
            assert isinstance(ask(m.Connect(node_id="t", agent=agent.metadata())), m.Connected)
            first = ask(m.Pin(namespace=LAYOUT.namespace, hashes=[keys[0].hash]))
            assert isinstance(first, m.Pinned) and len(first.slots) == 1 and first.lease
            busy = ask(m.Pin(namespace=LAYOUT.namespace, hashes=[keys[1].hash]))
            assert isinstance(busy, m.Refused) and busy.code == m.E_BUSY
            other = ask(m.Pin(namespace=LAYOUT.namespace, hashes=[keys[1].hash], v=99))
            assert isinstance(other, m.Refused) and other.code == m.E_VERSION
            assert p2p(ca)["serve"]["pinned_slots"] == 1
            assert ask(m.Unpin(lease=first.lease)) == m.Unpinned(count=1)
            again = ask(m.Pin(namespace=LAYOUT.namespace, hashes=[keys[1].hash]))
            assert isinstance(again, m.Pinned) and len(again.slots) == 1
            assert ask(m.Unpin(lease=again.lease)) == m.Unpinned(count=1)
            serve = p2p(ca)["serve"]
            assert serve["refused_busy"] == 1 and serve["pinned_slots"] == 0 and serve["leases"] == 0
        finally:
            s.close(0)
            ctx.term()
            agent.close()


def test_a_peer_that_restarts_and_reads_again_is_remembered_once(tmp_path, s3_server, s3_prefix, nodes):
    """B reads from A, restarts (a new process: a new socket identity and NIXL agent) and reads again: A keeps one
    entry for B, not one per connection it ever had (they grew without bound, each with a NIXL remote agent)."""
    a, b = pair(tmp_path, s3_server, s3_prefix, nodes)
    with a.client() as ca:
        for _ in range(2):
            keys = prompt(2)
            with b.client() as cb:
                assert wait_until(lambda cb=cb: ready(cb), WAIT_S)
                store(ca, keys)
                assert wait_until(lambda cb=cb, n=len(keys): learned(cb, n), WAIT_S), peer(cb)
                assert cb.lookup(keys).tiers == ["G2"] * 2, p2p_log(b)
            b.stop()
            b.start()
        assert p2p(ca)["serve"]["connects"] == 2
        assert p2p(ca)["serve"]["askers"] == 1
    # what an operator sees: `kvbm status --json` carries the peer reads (they were only in the Stats reply)
    from click.testing import CliRunner

    from kvbm.cli.main import main

    assert a.proc is not None
    r = CliRunner().invoke(main, ["status", "--json"], env={"KVBM_CONFIG": str(a.proc.cfg_path)},
                           catch_exceptions=False)
    assert json.loads(r.output)["fleet"]["p2p"]["serve"]["askers"] == 1, r.output


def rss_shmem(pid: int) -> int:
    """Bytes of shared memory mapped in the process's page tables (``RssShmem`` of ``/proc/PID/status``)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


def test_a_daemon_with_peer_reads_maps_its_whole_g2_before_any_read(tmp_path, s3_server, s3_prefix, nodes):
    """A peer READ into G2 slots this daemon had never touched paid for mapping their pages on the lookup's critical
    path (256 MiB: ~0.15 s of a 0.2 s READ under vLLM's server); the pool is now mapped in the background at start."""
    a = Node(tmp_path, "a", s3_server, s3_prefix)
    a.cfg["host"]["capacity"] = "48MiB"
    nodes.append(a.start())
    with a.client() as ca:
        assert wait_until(lambda: p2p(ca)["serve"] is not None, WAIT_S), p2p(ca)
    assert wait_until(lambda: rss_shmem(a.pid) >= 48 << 20, WAIT_S), f"{rss_shmem(a.pid) >> 20} MiB of G2 mapped"
