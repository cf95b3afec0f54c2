"""Many tenants on one daemon: who may connect, register, write and listen.

Every daemon is ``kvbm serve`` in a subprocess (tests/serve_proc.py); the clients are this process, and, where
the question is another local user, a pyzmq script run as uid 65534 (tests/otheruid.py)."""

from __future__ import annotations

import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from needs import require
from otheruid import PROBE, available, result, spawn_as_other
from serve_proc import ServeProc, wait_until

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError, WorkerClient

SLOT = 64 * 1024
LAYOUT_A = KVLayout(model="team-a/llama", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                    block_bytes=SLOT)
LAYOUT_B = KVLayout(model="team-b/qwen", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                    block_bytes=SLOT)
NB = LAYOUT_A.block_nbytes


def keys(n: int, ns: str, tag: bytes = b"") -> list[BlockKey]:
    return [BlockKey(ns, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def base_cfg(tmp: Path, **daemon: object) -> dict:
    return {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "4MiB"},
        "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"metrics_port": 0, **daemon},
    }


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp dirs are root's 0700 ones): the other uid must be kept
    out by the daemon's own socket directory, not by an accident of the test."""
    d = Path(tempfile.mkdtemp(prefix="kvbm-t-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_default_sockets_keep_other_users_out(open_dir: Path) -> None:
    """With the default endpoints another uid gets no answer to a Ping and no event batch while the owner
    stores; the owner (same uid) is served on those same defaults, and the other uid's probe does reach a
    socket it is allowed to (so the silence is the daemon's doing)."""
    require("otheruid", *available())
    cache = open_dir / "c"
    run = cache / "kvbm" / "run"
    run.mkdir(parents=True)
    for path in (cache, cache / "kvbm", run):  # opened by someone before the daemon starts: it closes it again
        path.chmod(0o755)
    d = ServeProc(open_dir, base_cfg(open_dir), env={"XDG_CACHE_HOME": str(cache)}).start()
    assert d.endpoint == f"ipc://{run}/kvbm.sock" and d.info["events"] == f"ipc://{run}/events.sock"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    ctx = zmq.Context()
    control = ctx.socket(zmq.ROUTER)  # answers anything: proves the other uid's probe can talk at all
    control.bind("tcp://127.0.0.1:*")
    control_ep = control.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()
    t = threading.Thread()
    try:
        events = d.info["events"]
        frame = p.encode(p.Ping(rid=1)).hex()
        stop = threading.Event()
        probe = spawn_as_other(PROBE, requests=[d.endpoint, control_ep], events=[events], frame=frame, wait_s=4.0)

        def echo() -> None:
            while not stop.is_set():
                if control.poll(100):
                    ident, *_rest = control.recv_multipart()
                    control.send_multipart([ident, b"pong"])

        t = threading.Thread(target=echo, daemon=True)
        t.start()
        time.sleep(1.0)  # the probe connects and subscribes
        with WorkerClient(d.endpoint, timeout_s=10) as c:  # the owner, on the same default endpoint
            c.ping()
            c.register(LAYOUT_A)
            for i in range(40):
                ks = keys(1, c.namespace, tag=bytes([i]))
                c.store(ks, [np.full(NB, i, dtype=np.uint8)])
                time.sleep(0.05)
        got = result(probe, timeout=30)
        assert "error" not in got, got
        assert got["replies"][control_ep] == 1, got
        assert got["replies"][d.endpoint] == 0, f"another uid was answered by the daemon: {got}"
        assert got["events"][events] == 0, f"another uid read the event stream: {got}"
        (open_dir / "second").mkdir()
        second = ServeProc(open_dir / "second", base_cfg(open_dir / "second"), env={"XDG_CACHE_HOME": str(cache)})
        with pytest.raises(RuntimeError, match="another process listens there"):
            second.start()  # with TCP the port was taken; an ipc path must be refused the same way
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        control.close(0)
        ctx.term()
        d.stop()


# -- tenants ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    """A daemon serving two tenants: a (models team-a/*, 2 workers, 4 requests in flight) and b (one namespace)."""
    tmp = tmp_path_factory.mktemp("ten")
    cfg = base_cfg(tmp, endpoint=f"ipc://{tmp}/d.sock", events_endpoint=f"ipc://{tmp}/ev.sock", barrier_timeout_s=1.0,
                   tenants=[
        {"name": "a", "token_file": str(tmp / "a.token"), "models": ["team-a/*"], "max_workers": 2, "max_inflight": 4},
        {"name": "b", "token_file": str(tmp / "b.token"), "namespaces": [LAYOUT_B.namespace]},
    ])
    d = ServeProc(tmp, cfg).start()  # creates a.token and b.token (0600) at first start
    yield d
    d.stop()


def tenant_client(d: ServeProc, name: str, **kw: object) -> WorkerClient:
    return d.client(tenant_token=(d.tmp / f"{name}.token").read_text().strip(), **kw)


def refusal(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(DaemonError) as e:
        fn(*args, **kw)  # type: ignore[operator]
    return e.value.code


def test_a_tenant_registers_only_what_its_credential_names(tenants: ServeProc) -> None:
    with tenant_client(tenants, "a") as a, tenant_client(tenants, "b") as b, tenants.client() as anon:
        a.register(LAYOUT_A)
        b.register(LAYOUT_B)
        with tenant_client(tenants, "a") as a2:
            assert refusal(a2.register, LAYOUT_B) == p.E_FORBIDDEN  # b's model: whatever layout a sends
        with tenant_client(tenants, "b") as b2:
            assert refusal(b2.register, LAYOUT_A) == p.E_FORBIDDEN
        assert refusal(anon.register, LAYOUT_A) == p.E_FORBIDDEN  # no credential on a daemon with tenants
        with tenants.client(tenant_token="x" * 43) as bad:
            assert refusal(bad.register, LAYOUT_A) == p.E_FORBIDDEN
        with tenants.client(admin=True) as admin:
            admin.register(LAYOUT_B)  # the operator may look at any namespace
        ks = keys(2, a.namespace)
        a.store(ks, [np.full(NB, 7, dtype=np.uint8)] * 2)
        assert a.lookup(ks).matched == 2
        assert refusal(b.lookup, ks) == p.E_FORBIDDEN  # a's namespace is not b's to probe


def test_on_a_daemon_with_tenants_only_the_admin_token_subscribes_to_events(tenants: ServeProc) -> None:
    """A PUB socket cannot filter per subscriber: with tenants a subscriber needs the admin token (PLAIN), and a
    tenant's process, though it reaches the socket, reads nothing of anyone's stores."""
    ctx = zmq.Context()
    subs = {}
    for who, password in (("none", None), ("tenant", (tenants.tmp / "b.token").read_text().strip()),
                          ("admin", tenants.admin_token())):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if password is not None:
            sub.plain_username, sub.plain_password = b"admin", password.encode()
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tenants.tmp}/ev.sock")
        subs[who] = sub
    try:
        got = dict.fromkeys(subs, 0)
        with tenant_client(tenants, "a") as a:
            a.register(LAYOUT_A)
            for i in range(20):  # until the admin's subscription has seen stores (it joins asynchronously)
                a.store(keys(1, a.namespace, bytes([0xE0, i])), [np.full(NB, i, dtype=np.uint8)])
                for who, sub in subs.items():
                    while sub.poll(50):
                        sub.recv_multipart()
                        got[who] += 1
                if got["admin"] >= 3:
                    break
        assert got["admin"] >= 3 and got["none"] == 0 and got["tenant"] == 0, got
    finally:
        for sub in subs.values():
            sub.close(0)
        ctx.term()


def test_a_worker_id_belongs_to_the_credential_that_created_it(tenants: ServeProc) -> None:
    with tenant_client(tenants, "a") as a, tenant_client(tenants, "b") as b:
        a.register(LAYOUT_A, worker_id="shared-name")
        assert refusal(b.register, LAYOUT_B, worker_id="shared-name") == p.E_FORBIDDEN
        a.ping()  # a's session survived the attempt
        assert a.lookup(keys(1, a.namespace, b"\xff")).matched == 0
        with tenant_client(tenants, "a") as again:  # the same credential may replace it (a restarted worker)
            again.register(LAYOUT_A, worker_id="shared-name")
            again.ping()


def test_a_tenant_floods_only_its_own_registrations_and_requests(tenants: ServeProc) -> None:
    """a's third worker is refused `limit` (b still registers); a's fifth request in flight is refused `busy`
    at once (load, not a bad field: `limit` stays "out of bounds") while b is served; a Barrier naming an hour
    waits only daemon.barrier_timeout_s."""
    with tenant_client(tenants, "a") as a1, tenant_client(tenants, "a") as a2, tenant_client(tenants, "a") as a3:
        a1.register(LAYOUT_A)
        a2.register(LAYOUT_A)
        assert refusal(a3.register, LAYOUT_A) == p.E_LIMIT
        with tenant_client(tenants, "b") as b:
            b.register(LAYOUT_B)
            ctx = zmq.Context()
            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.LINGER, 0)
            flood.connect(tenants.endpoint)
            try:
                for i in range(20):  # a's Barriers that would wait an hour, 4 of them at most in flight
                    flood.send(p.encode(p.Barrier(token=a1.token, rid=i + 1, engine_id="engine", step=i, rank=0,
                                                  world_size=2, timeout_s=3600)))
                b.lookup(keys(4, b.namespace))  # served while a's flood is in flight
                b.ping()
                codes: dict[str, int] = {}
                while sum(codes.values()) < 20:
                    # A generous deadline (the Barriers asked for an hour; the daemon bounds them to 1 s).
                    assert flood.poll(15_000), f"a's flood was not answered within 15 s: {codes}"
                    rep = p.decode_reply(flood.recv())
                    key = rep.code if isinstance(rep, p.Error) else type(rep).__name__
                    codes[key] = codes.get(key, 0) + 1
                assert codes == {p.E_BUSY: 16, "BarrierReply": 4}, codes
            finally:
                flood.close(0)
                ctx.term()
        assert a1.stats()["daemon"]["client_limited"] >= 16


def test_an_engine_id_is_its_credentials_own(tenants: ServeProc) -> None:
    """engine_id is the client's choice: tenant b registering a's engine_id gets b's own engine of that name, so
    b's rank cannot complete (nor join) a barrier of a's engine; a's ranks still meet each other."""
    with tenant_client(tenants, "a") as a0, tenant_client(tenants, "a") as a1, tenant_client(tenants, "b") as b:
        a0.register(LAYOUT_A, engine_id="eng-x", tp_rank=0, tp_size=2)
        a1.register(LAYOUT_A, engine_id="eng-x", tp_rank=1, tp_size=2)
        b.register(LAYOUT_B, engine_id="eng-x", tp_rank=1, tp_size=2)
        replies: dict[str, p.BarrierReply] = {}
        t = threading.Thread(target=lambda: replies.setdefault("a0", a0.barrier("eng-x", "s1", 0, 2, timeout_s=1.0)))
        t.start()
        time.sleep(0.2)  # a0 waits at the barrier
        replies["b"] = b.barrier("eng-x", "s1", 1, 2, timeout_s=1.0)
        t.join()
        assert not replies["a0"].complete and replies["a0"].arrived == 1, replies  # b's rank is not a's
        assert not replies["b"].complete and replies["b"].arrived == 1, replies
        t = threading.Thread(target=lambda: replies.setdefault("a1", a1.barrier("eng-x", "s2", 1, 2, timeout_s=5.0)))
        t.start()
        assert a0.barrier("eng-x", "s2", 0, 2, timeout_s=5.0).complete
        t.join()
        assert replies["a1"].complete


def flood_barriers(endpoint: str, token: str, n: int) -> zmq.Socket:
    """``n`` Barriers asking to wait an hour for a rank that never comes, sent without waiting for replies."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for i in range(n):
        sock.send(p.encode(p.Barrier(token=token, rid=i + 1, engine_id="engine", step=i, rank=0, world_size=2,
                                     timeout_s=3600)))
    return sock


def test_one_workers_barrier_flood_leaves_other_workers_served(tmp_path: Path) -> None:
    """Without tenants: 1,100 hour-long Barriers from one worker (more than daemon.max_inflight, 1,024) neither
    stop the daemon reading nor delay another worker's Lookup; beyond the worker's cap they are refused `busy`,
    and those admitted end after daemon.barrier_timeout_s."""
    d = ServeProc(tmp_path, base_cfg(tmp_path, endpoint=f"ipc://{tmp_path}/d.sock", events_endpoint="",
                                     barrier_timeout_s=1.0)).start()
    try:
        with d.client() as flooder, d.client() as other:
            flooder.register(LAYOUT_A)
            other.register(LAYOUT_B, worker_id="other")
            sock = flood_barriers(d.endpoint, flooder.token, 1100)
            try:
                time.sleep(1.0)  # the daemon reads the whole flood before the other worker asks
                assert other.lookup(keys(4, other.namespace)).matched == 0  # served (else DaemonUnavailable)
                codes: dict[str, int] = {}
                while sum(codes.values()) < 1100:
                    # A generous deadline: the Barriers asked for an hour, the daemon bounds them to 1 s.
                    assert sock.poll(20_000), f"the flood was not answered within 20 s: {codes}"
                    rep = p.decode_reply(sock.recv())
                    key = rep.code if isinstance(rep, p.Error) else type(rep).__name__
                    codes[key] = codes.get(key, 0) + 1
                assert codes == {"BarrierReply": 256, p.E_BUSY: 844}, codes  # daemon.max_inflight_per_client
            finally:
                sock.close(0)
    finally:
        d.stop()


# -- events with CURVE ------------------------------------------------------------------------------------
def _curve_sub(ctx: zmq.Context, endpoint: str, server: bytes, keypair: tuple[bytes, bytes]) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.curve_serverkey, (sub.curve_publickey, sub.curve_secretkey) = server, keypair
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def test_with_curve_only_admin_keys_read_a_tenant_daemons_events(tmp_path: Path) -> None:
    """The cross-host set-up: every tenant's host is in curve_clients_dir, so the request socket admits it; the
    events socket admits only curve_admin_clients_dir's keys (and the daemon's own), so tenant a's host reads
    none of the block events (namespaces, hashes) while the operator's key reads them."""
    require("curve", zmq.has("curve"), "libzmq without CURVE")
    from kvbm.security import load_keypair, write_keypair

    keydir, allowed, admins = tmp_path / "keys", tmp_path / "clients", tmp_path / "admins"
    allowed.mkdir()
    admins.mkdir()
    _srv_pub, srv_secret = write_keypair(keydir, "server")
    pairs = {}
    for name in ("tenant-a", "operator"):
        public, secret = write_keypair(keydir, name)
        shutil.copy(public, allowed / public.name)
        pairs[name] = load_keypair(secret)
    shutil.copy(keydir / "operator.key", admins / "operator.key")
    server = load_keypair(srv_secret)[0]
    events = f"ipc://{tmp_path}/ev.sock"
    cfg = base_cfg(tmp_path, endpoint=f"ipc://{tmp_path}/d.sock", events_endpoint=events,
                   curve_server_key_file=str(srv_secret), curve_clients_dir=str(allowed),
                   curve_admin_clients_dir=str(admins),
                   tenants=[{"name": "a", "token_file": str(tmp_path / "a.token"), "models": ["team-a/*"]}])
    d = ServeProc(tmp_path, cfg).start()
    ctx = zmq.Context()
    subs = {name: _curve_sub(ctx, events, server, kp) for name, kp in pairs.items()}
    try:
        got = dict.fromkeys(subs, 0)
        with tenant_client(d, "a", curve_server_key=server.decode(), curve_keypair=pairs["tenant-a"]) as a:
            a.register(LAYOUT_A)  # the tenant's key passes the request socket
            for i in range(40):  # until the operator's subscription has seen stores (it joins asynchronously)
                a.store(keys(1, a.namespace, bytes([0xC0, i])), [np.full(NB, i, dtype=np.uint8)])
                for name, sub in subs.items():
                    while sub.poll(50):
                        sub.recv_multipart()
                        got[name] += 1
                if got["operator"] >= 3:
                    break
        assert got["operator"] >= 3 and got["tenant-a"] == 0, f"event batches read per key: {got}"
    finally:
        for sub in subs.values():
            sub.close(0)
        ctx.term()
        d.stop()


# -- slot budgets -----------------------------------------------------------------------------------------
def onboard(c: WorkerClient, ks: list[BlockKey]) -> p.Onboarded:
    """Pin ``ks`` in G2 and keep them pinned (no Release): what a worker holds while it copies out."""
    return c.request(p.Onboard(namespace=ks[0].namespace, hashes=[k.hash for k in ks]), p.Onboarded)


def release(c: WorkerClient, ks: list[BlockKey]) -> int:
    return c.request(p.Release(namespace=ks[0].namespace, hashes=[k.hash for k in ks]), p.Released).count


def full_message(fn: object, *args: object) -> str:
    with pytest.raises(DaemonError) as e:
        fn(*args)  # type: ignore[operator]
    assert e.value.code == p.E_FULL, e.value  # load, not failure: the connector retries or computes
    return e.value.message


def test_a_tenant_cannot_hold_all_of_g2(tmp_path: Path) -> None:
    """Tenant a (max_slots 8) pins 8 blocks and keeps pinging: its 9th pin and its PrepareStore are refused
    `full` naming its budget, while tenant b (the default share: half of G2's 64 slots) pins 20 blocks and
    stores; once a releases it pins again. Registered states each session's budget (a rank of a TP=2 engine:
    half its tenant's)."""
    cfg = base_cfg(tmp_path, endpoint=f"ipc://{tmp_path}/d.sock", events_endpoint="", tenants=[
        {"name": "a", "token_file": str(tmp_path / "a.token"), "models": ["team-a/*"], "max_slots": 8},
        {"name": "b", "token_file": str(tmp_path / "b.token"), "models": ["team-b/*"]},
    ])
    d = ServeProc(tmp_path, cfg).start()
    try:
        with tenant_client(d, "a") as a, tenant_client(d, "b") as b:
            reg_a, reg_b = a.register(LAYOUT_A), b.register(LAYOUT_B)
            held = keys(12, a.namespace, b"held")
            for part in (held[:6], held[6:]):  # a PrepareStore holds slots until its commit: at most 8 at once
                a.store(part, [np.full(NB, 1, dtype=np.uint8)] * 6)  # committed blocks are cache: not a's to hold
            assert onboard(a, held[:8]).count == 8
            a.ping()  # a renewed lease does not renew a budget
            why = full_message(onboard, a, held[8:9])
            assert "tenant 'a'" in why and "max_slots" in why and "8" in why, why
            new = keys(2, a.namespace, b"new")
            why = full_message(a.request, p.PrepareStore(namespace=a.namespace, hashes=[k.hash for k in new],
                                                         nbytes=NB), p.Slots)
            assert "max_slots" in why, why
            theirs = keys(20, b.namespace, b"b")
            b.store(theirs, [np.full(NB, 2, dtype=np.uint8)] * 20)
            assert onboard(b, theirs).count == 20  # b is served while a sits at its cap
            assert release(a, held[:8]) == 8
            assert onboard(a, held[4:12]).count == 8
            assert reg_a.session_slots == 8 and reg_b.session_slots == 32, (reg_a, reg_b)
            with tenant_client(d, "b") as b1:  # a rank of a TP=2 engine: the engine's share, halved
                assert b1.register(LAYOUT_B, worker_id="b-r1", tp_rank=1, tp_size=2).session_slots == 16
    finally:
        d.stop()


def test_a_session_holds_at_most_its_stated_budget(tmp_path: Path) -> None:
    """daemon.max_session_slots 4: each session is told 4 in Registered; its fifth slot (pinned or prepared)
    is refused `full` naming the budget, and another session of the same daemon still gets its own 4."""
    d = ServeProc(tmp_path, base_cfg(tmp_path, endpoint=f"ipc://{tmp_path}/d.sock", events_endpoint="",
                                     max_session_slots=4)).start()
    try:
        with d.client() as one, d.client() as two:
            reg = one.register(LAYOUT_A)
            two.register(LAYOUT_A, worker_id="two")
            ks = keys(8, one.namespace, b"s")
            for part in (ks[:4], ks[4:]):
                one.store(part, [np.full(NB, 3, dtype=np.uint8)] * 4)
            assert onboard(one, ks[:3]).count == 3
            slots = one.request(p.PrepareStore(namespace=one.namespace, hashes=[keys(1, one.namespace, b"p")[0].hash],
                                               nbytes=NB), p.Slots).slots
            assert slots[0] is not None  # 3 pinned + 1 prepared: the budget is full
            why = full_message(onboard, one, ks[3:4])
            assert "session" in why and "max_session_slots" in why, why
            assert onboard(two, ks[:4]).count == 4
            assert reg.session_slots == 4
    finally:
        d.stop()


# -- what a refused or departed registration costs ---------------------------------------------------------
def bucket_cfg(tmp: Path, s3: dict, **daemon: object) -> dict:
    cfg = base_cfg(tmp, endpoint=f"ipc://{tmp}/d.sock", events_endpoint="", index_bucket="lazy", **daemon)
    cfg["s3"] = {"enabled": True, **s3}
    return cfg


def layout(model: str) -> KVLayout:
    return KVLayout(model=model, num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)


def test_a_register_refused_at_max_workers_lists_nothing(tmp_path: Path, s3_server, s3_prefix: str) -> None:
    """The limits are checked before the bucket is listed for the new namespace: 10 Registers with fresh model
    names beyond max_workers are refused `limit` and none of them costs a LIST (namespaces_indexed stays 1)."""
    s3 = {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
          "access_key": s3_server.access_key, "secret_key": s3_server.secret_key}
    d = ServeProc(tmp_path, bucket_cfg(tmp_path, s3, max_workers=1)).start()
    try:
        with d.client() as first:
            first.register(layout("listed-model"))
            for i in range(10):
                with d.client() as extra:
                    assert refusal(extra.register, layout(f"random-{i}"), worker_id=f"x{i}") == p.E_LIMIT
            daemon = first.stats()["daemon"]
            assert daemon["namespaces_indexed"] == 1 and daemon["refused_workers"] == 10, daemon
    finally:
        d.stop()


def test_namespaces_whose_listing_failed_are_retried_only_while_registered(tmp_path: Path) -> None:
    """S3 down (nothing listens at its endpoint): 20 workers register a namespace each and leave again. The
    daemon keeps retrying only the namespaces a registered worker still uses (none once they left), not one
    retry task per namespace ever seen."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: every S3 request is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    s3 = {"endpoint": f"http://127.0.0.1:{port}", "bucket": "kvbm-down", "access_key": "k", "secret_key": "s",
          "max_retries": 0}
    d = ServeProc(tmp_path, bucket_cfg(tmp_path, s3)).start()
    try:
        with d.client() as stay:
            stay.register(layout("stays"), worker_id="stays")
            for i in range(20):
                with d.client() as c:
                    c.register(layout(f"leaves-{i}"), worker_id=f"l{i}")
            # Retries run on a backoff of 0.5 s and more: wait until one has passed for every namespace.
            pending = wait_until(lambda: stay.stats()["daemon"]["namespaces_pending"] <= 1, timeout=30)
            assert stay.stats()["daemon"]["namespaces_pending"] == 1, pending
    finally:
        d.stop()


# -- tenants that would share namespaces ---------------------------------------------------------------
def test_overlapping_tenant_models_are_refused_at_start(tmp_path: Path) -> None:
    """Two tenants allowed `meta-llama/*` and `meta-llama/Llama-3*` would read and overwrite each other's blocks:
    `kvbm serve` refuses the config, naming both tenants and the field."""
    cfg = base_cfg(tmp_path, endpoint=f"ipc://{tmp_path}/d.sock", events_endpoint="", tenants=[
        {"name": "a", "token_file": str(tmp_path / "a.token"), "models": ["team-a/*", "meta-llama/*"]},
        {"name": "b", "token_file": str(tmp_path / "b.token"), "models": ["meta-llama/Llama-3*"]},
    ])
    d = ServeProc(tmp_path, cfg)
    with pytest.raises(RuntimeError) as e:
        d.start()
        d.stop()
    assert "daemon.tenants[1].models" in str(e.value) and "'a'" in str(e.value) and "'b'" in str(e.value), e.value


@pytest.mark.parametrize(("x", "y", "overlap"), [
    ("meta-llama/*", "meta-llama/*", True), ("*", "team-a/llama", True), ("a*", "*b", True),
    ("team-?/x", "team-a/*", True), ("[ab]-model", "b-*", True), ("[!a]x", "ax", False),
    ("team-a/*", "team-b/*", False), ("a*c", "*b", False), ("org/[0-9]*", "org/x*", False),
])
def test_model_pattern_overlap(x: str, y: str, overlap: bool) -> None:
    """Whether some model name matches both patterns, decided exactly (not just by matching one against the
    other's text: `a*` and `*b` share `ab`)."""
    from kvbm.config import load_config
    from kvbm.errors import ConfigError

    env = {"KVBM_DAEMON_TENANTS": f'[{{name: x, token_file: /x, models: ["{x}"]}}, '
                                  f'{{name: y, token_file: /y, models: ["{y}"]}}]'}
    if overlap:
        with pytest.raises(ConfigError, match=r"daemon\.tenants\[1\]\.models"):
            load_config(environ=env)
    else:
        load_config(environ=env)
