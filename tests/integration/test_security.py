"""Who may read, evict and probe whose cache: namespace-bound tokens, the admin token file, CURVE with a
client allow-list on both daemon sockets, bounded requests, and secrets that never reach an output.

Every daemon here is ``kvbm serve`` in a subprocess (tests/serve_proc.py) over real sockets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from needs import needs
from serve_proc import ServeProc

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient

SLOT = 64 * 1024
LAYOUT_A = KVLayout(model="tenant-a", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
LAYOUT_B = KVLayout(model="tenant-b", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=SLOT)
NB = LAYOUT_A.block_nbytes
FORBIDDEN, LIMIT = "forbidden", "limit"  # p.E_FORBIDDEN, p.E_LIMIT (tests/unit/test_protocol.py checks they agree)
curve = needs("curve", zmq.has("curve"), "libzmq without CURVE")


def keys(n, tag=b"", ns=LAYOUT_A.namespace):
    return [BlockKey(ns, (tag + i.to_bytes(4, "big")).ljust(32, b"\x00")) for i in range(n)]


def payload(key):
    rng = np.random.default_rng(int.from_bytes(key.hash[:8], "big"))
    return rng.integers(0, 256, NB, dtype=np.uint8)


def daemon_cfg(tmp: Path, **daemon) -> dict:
    d = {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock", "metrics_port": 0,
         **daemon}
    return {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "4MiB"},
        "disk": {"dir": str(tmp / "disk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"}, "daemon": d,
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secd")
    d = ServeProc(tmp, daemon_cfg(tmp)).start()
    yield d
    d.stop()


def code_of(fn, *args, **kw) -> str:
    with pytest.raises(DaemonError) as ei:
        fn(*args, **kw)
    return ei.value.code


def forbidden_count(c) -> int:
    return int(c.stats()["daemon"]["errors"].get(FORBIDDEN, 0))


# -- namespaces ----------------------------------------------------------------------------------------------
def test_a_worker_of_namespace_x_cannot_touch_namespace_y(daemon):
    a_keys = keys(3, b"a")
    with daemon.client() as a, daemon.client() as b:
        a.register(LAYOUT_A, worker_id="tenant-a", engine_id="eng-a")
        b.register(LAYOUT_B, worker_id="tenant-b", engine_id="eng-b")
        assert a.store(a_keys, [payload(k) for k in a_keys]).stored == 3
        before = forbidden_count(b)
        ns, hs = LAYOUT_A.namespace, [k.hash for k in a_keys]
        # B probes, onboards, releases and stores under A's namespace, and joins A's engine barrier.
        refused = [
            code_of(b.request, p.Lookup(namespace=ns, hashes=hs), p.LookupReply),
            code_of(b.request, p.Onboard(namespace=ns, hashes=hs), p.Onboarded),
            code_of(b.request, p.Release(namespace=ns, hashes=hs), p.Released),
            code_of(b.request, p.PrepareStore(namespace=ns, hashes=[b"\x07" * 32], nbytes=NB), p.Slots),
            code_of(b.request, p.CommitStore(namespace=ns, hashes=hs, ok=False), p.Ack),
            code_of(b.request, p.Barrier(engine_id="eng-a", step=1, rank=0, world_size=1), p.BarrierReply),
        ]
        assert refused == [FORBIDDEN] * 6
        assert forbidden_count(b) == before + 6  # refusals are counted
        # Nothing of A's was touched: still held, no pin left behind, and A still reads its bytes.
        assert a.lookup(a_keys).matched == 3
        assert a.stats()["daemon"]["pins"] == 0
        outs = [np.zeros(NB, np.uint8) for _ in a_keys]
        assert a.load(a_keys, outs) == 3
        assert all(np.array_equal(o, payload(k)) for o, k in zip(outs, a_keys, strict=True))
        assert b.lookup(keys(3, b"a", ns=LAYOUT_B.namespace)).matched == 0  # its own namespace works


# -- the admin token -----------------------------------------------------------------------------------------
def test_evict_reindex_and_resident_need_the_admin_token_file(daemon):
    path = daemon.admin_token_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # created by kvbm serve at first start
    ks = keys(2, b"ev")
    with daemon.client() as w:
        w.register(LAYOUT_A, worker_id="plain")
        w.store(ks, [payload(k) for k in ks])
        before = forbidden_count(w)
        assert code_of(w.evict, ks, tiers=["G2"]) == FORBIDDEN
        assert code_of(w.evict, namespace=LAYOUT_A.namespace) == FORBIDDEN
        assert code_of(w.request, p.Reindex(namespace=LAYOUT_A.namespace), p.Reindexed) == FORBIDDEN
        assert code_of(w.stats, resident=True) == FORBIDDEN
        assert forbidden_count(w) == before + 4
        assert w.stats()["tiers"]  # aggregate counters stay readable
        assert w.lookup(ks).tiers == ["G2", "G2"]
    with pytest.raises(DaemonError) as ei:  # a wrong token is refused at Register
        WorkerClient(daemon.endpoint, timeout_s=5, admin_token="guess").register(LAYOUT_A, worker_id="guess")
    assert ei.value.code == FORBIDDEN
    with daemon.client(admin=True) as adm:  # the token as a user reads it from the file
        adm.register(LAYOUT_B, worker_id="admin")
        assert adm.evict(ks, tiers=["G2"]).removed == 2  # another namespace's blocks, on the admin's say
        assert adm.lookup(ks).tiers == ["G3", "G3"]
        assert adm.request(p.Reindex(namespace=LAYOUT_A.namespace), p.Reindexed).blocks >= 2
        assert "engines" in adm.stats(resident=True)
        # Any namespace, but a well-formed one: it becomes file and object names.
        for ns in ("../../../etc-0123456789abcdef", "a/b-0123456789abcdef", "NS"):
            assert code_of(adm.request, p.Evict(namespace=ns, hashes=[b"x" * 32]), p.Evicted) == "bad_request"


def test_kvbm_purge_and_status_against_a_running_daemon_use_the_token_file(tmp_path):
    d = ServeProc(tmp_path, daemon_cfg(tmp_path)).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}

    def kvbm(cfg: Path, *args):
        return subprocess.run([sys.executable, "-m", "kvbm.cli.main", *args, "--config", str(cfg)],
                              capture_output=True, text=True, env=env, timeout=120)

    try:
        ks = keys(4, b"pg")

        def g3_blocks() -> int:
            with d.client() as c:
                return next(t["blocks"] for t in c.stats()["tiers"] if t["tier"] == "G3")

        with d.client() as c:
            c.register(LAYOUT_A, worker_id="writer")
            c.store(ks, [payload(k) for k in ks], durable=True)
        disk_files = lambda: sorted((tmp_path / "disk").rglob("*.kvb"))  # noqa: E731
        assert g3_blocks() == 4 and len(disk_files()) == 4
        # A config naming a token file this user does not have: the daemon refuses the purge, says why.
        other = tmp_path / "no-admin.yaml"
        cfg = json.loads(d.cfg_path.read_text())
        cfg["daemon"]["admin_token_file"] = str(tmp_path / "missing.token")
        other.write_text(json.dumps(cfg))
        r = kvbm(other, "purge", "--namespace", LAYOUT_A.namespace, "--all", "--yes", "--json")
        assert r.returncode != 0 and "admin token" in r.stderr, r.stdout + r.stderr
        assert g3_blocks() == 4 and len(disk_files()) == 4  # nothing deleted behind the daemon's back
        # The daemon's own config: the CLI reads the token file, deletes, and the daemon drops its entries.
        r = kvbm(d.cfg_path, "purge", "--namespace", LAYOUT_A.namespace, "--all", "--yes", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        out = json.loads(r.stdout)
        assert out["deleted"] == 4 and "dropped 4 index entries from G3" in out["daemon"], out
        assert g3_blocks() == 0 and disk_files() == []
        st = kvbm(d.cfg_path, "status", "--json")
        assert st.returncode == 0 and json.loads(st.stdout)["mode"] == "daemon", st.stdout + st.stderr
        token = d.admin_token()
        assert token not in r.stdout + r.stderr + st.stdout + d.log_path.read_text()
    finally:
        d.stop()


# -- input bounds --------------------------------------------------------------------------------------------
def test_valid_but_hostile_requests_get_typed_errors_and_the_daemon_keeps_serving(daemon):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    with daemon.client() as w:
        reg = w.register(LAYOUT_A, worker_id="hostile-target")
        tok, ns, V = reg.token, reg.namespace, p.PROTOCOL_VERSION

        def raw(**m):
            return msgspec.msgpack.encode({"v": V, "token": tok, **m})

        cases = {
            "huge batch": (raw(type="Lookup", rid=1, namespace=ns, hashes=[b"h" * 8] * (p.MAX_BATCH + 1)), LIMIT),
            "long hash": (raw(type="Lookup", rid=2, namespace=ns, hashes=[b"h" * 33]), LIMIT),
            "empty hash": (raw(type="Lookup", rid=3, namespace=ns, hashes=[b""]), LIMIT),
            "long namespace": (raw(type="Lookup", rid=4, namespace="n" * 300, hashes=[]), LIMIT),
            "long token": (msgspec.msgpack.encode({"type": "Ping", "v": V, "rid": 5, "token": "t" * 300}), LIMIT),
            "negative nbytes": (raw(type="PrepareStore", rid=6, namespace=ns, hashes=[b"x"], nbytes=-1), LIMIT),
            "negative rank": (raw(type="Barrier", rid=7, engine_id="engine", step=1, rank=-1), LIMIT),
            "many tiers": (raw(type="Evict", rid=8, namespace=ns, tiers=["G2"] * 17), LIMIT),
            "long worker id": (msgspec.msgpack.encode({"type": "Register", "v": V, "rid": 9, "worker_id": "w" * 300,
                                                       "engine_id": "e", "layout": msgspec.to_builtins(LAYOUT_A)}),
                               LIMIT),
            "long model": (p.encode(p.Register(rid=10, worker_id="m", engine_id="e",
                                               layout=msgspec.structs.replace(LAYOUT_A, model="m" * 300))), LIMIT),
            "foreign namespace": (raw(type="Lookup", rid=11, namespace=LAYOUT_B.namespace, hashes=[b"x"]),
                                  FORBIDDEN),
            "stale token": (msgspec.msgpack.encode({"type": "Lookup", "v": V, "rid": 12, "token": "0" * 32,
                                                    "namespace": ns, "hashes": [b"x"]}), p.E_UNREGISTERED),
            "stale generation": (raw(type="Onboard", rid=13, namespace=ns, hashes=[b"x"], generation="old"),
                                 p.E_STALE),
        }
        got = {}
        for name, (buf, _want) in cases.items():
            assert len(buf) < 4 * 1024 * 1024, name
            s.send(buf)
            assert s.poll(10_000), f"no reply to {name}"
            rep = p.decode_reply(s.recv())
            got[name] = rep.code if isinstance(rep, p.Error) else type(rep).__name__
        assert got == {name: want for name, (_b, want) in cases.items()}
        assert w.lookup(keys(1, b"alive")).matched == 0  # still serving, this worker still registered
    s.close(0)


# -- CURVE ---------------------------------------------------------------------------------------------------
def kvbm_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvbm.cli.main", *args], capture_output=True, text=True,
                          env=env or {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}, timeout=120)


def generate(keydir: Path, name: str) -> dict:
    r = kvbm_cli("keys", "generate", "--dir", str(keydir), "--name", name)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@curve
def test_kvbm_keys_generate_writes_a_private_keypair(tmp_path):
    import zmq.auth

    info = generate(tmp_path, "w1")
    secret, public = Path(info["secret_key_file"]), Path(info["public_key_file"])
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert sec and pub.decode() == info["public_key"] and zmq.auth.load_certificate(str(public)) == (pub, None)
    assert sec.decode() not in json.dumps(info)
    assert kvbm_cli("keys", "generate", "--dir", str(tmp_path), "--name", "w1").returncode != 0  # no overwrite


@curve
def test_curve_daemon_serves_allow_listed_clients_only_on_both_sockets(tmp_path):
    from kvbm.integrations.vllm import Link, curve_options
    from kvbm.security import load_keypair

    keydir, allowed = tmp_path / "keys", tmp_path / "clients"
    server = generate(keydir, "server")
    good, bad = generate(keydir, "good"), generate(keydir, "bad")
    allowed.mkdir()
    (allowed / "good.key").write_text(Path(good["public_key_file"]).read_text())
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, curve_server_key_file=server["secret_key_file"],
                                       curve_clients_dir=str(allowed))).start()
    try:
        srv = server["public_key"]
        ks = keys(2, b"cv")
        with WorkerClient(d.endpoint, timeout_s=10, curve_server_key=srv,
                          curve_keypair=load_keypair(good["secret_key_file"])) as c:
            c.register(LAYOUT_A, worker_id="good")
            # Events: an allow-listed subscriber gets the daemon's block events; one not listed gets none.
            subs = {}
            for name, info in (("good", good), ("bad", bad), ("plain", None)):
                sub = zmq.Context.instance().socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                if info is not None:
                    pub_k, sec_k = load_keypair(info["secret_key_file"])
                    sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = srv.encode(), pub_k, sec_k
                sub.setsockopt(zmq.SUBSCRIBE, p.EVENTS_TOPIC)
                sub.connect(f"ipc://{tmp_path}/events.sock")
                subs[name] = sub
            got = None
            for i in range(100):  # a SUB joins asynchronously: store until the allowed one hears
                c.store(keys(1, b"ev%d" % i), [payload(keys(1)[0])])
                if subs["good"].poll(200):
                    got = p.decode_events(subs["good"].recv_multipart()[2])
                    break
            assert got is not None and got.events[0].namespace == LAYOUT_A.namespace
            assert c.store(ks, [payload(k) for k in ks]).stored == 2
            assert subs["good"].poll(10_000)
            assert not subs["bad"].poll(0) and not subs["plain"].poll(0)
            for sub in subs.values():
                sub.close(0)
        with pytest.raises(DaemonUnavailable):  # a client not in the allow-list gets no answer
            WorkerClient(d.endpoint, timeout_s=2, curve_server_key=srv,
                         curve_keypair=load_keypair(bad["secret_key_file"])).register(LAYOUT_A, worker_id="bad")
        with pytest.raises(DaemonUnavailable):  # nor one with a throwaway key
            WorkerClient(d.endpoint, timeout_s=2, curve_server_key=srv).register(LAYOUT_A, worker_id="anon")

        # The vLLM connector's extra config: its CURVE settings build the client it registers with.
        extra = {"curve_server_key_file": server["public_key_file"], "curve_client_key_file": good["secret_key_file"]}
        opts = curve_options(extra)
        assert opts["curve_server_key"] == srv and opts["curve_keypair"] == load_keypair(good["secret_key_file"])

        class _G:  # the block geometry is resolved against the daemon; one kvbm block per vLLM block here
            def resolve(self, _slot):
                return 1

        link = Link(d.endpoint, _G(), lambda _k: LAYOUT_A, "eng-curve", "connector-r0", 10.0, opts)
        client = link.get()
        assert client is not None, link.degraded_reason
        assert client.lookup(ks).matched == 2
        link.close()
        bad_link = Link(d.endpoint, _G(), lambda _k: LAYOUT_A, "eng-curve", "connector-bad", 2.0,
                         curve_options({**extra, "curve_client_key_file": bad["secret_key_file"]}))
        assert bad_link.get() is None and "DaemonUnavailable" in bad_link.degraded_reason

        # The CLI with its keypair file (and the admin token file) works against this daemon.
        cli_cfg = json.loads(d.cfg_path.read_text())
        cli_cfg["daemon"] = {"endpoint": d.endpoint, "curve_public_key": srv,
                             "curve_client_key_file": good["secret_key_file"],
                             "admin_token_file": str(d.admin_token_path)}
        (tmp_path / "cli.yaml").write_text(json.dumps(cli_cfg))
        r = kvbm_cli("status", "--json", "--daemon", d.endpoint, "--config", str(tmp_path / "cli.yaml"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["mode"] == "daemon"
        cli_cfg["daemon"]["curve_client_key_file"] = bad["secret_key_file"]
        (tmp_path / "cli-bad.yaml").write_text(json.dumps(cli_cfg))
        r = kvbm_cli("status", "--json", "--daemon", d.endpoint, "--timeout", "2",
                     "--config", str(tmp_path / "cli-bad.yaml"))
        assert r.returncode != 0 and "did not answer" in r.stderr, r.stdout + r.stderr
    finally:
        d.stop()


@curve
def test_unsafe_daemon_configs_are_refused_at_start(tmp_path):
    pub, sec = (k.decode() for k in zmq.curve_keypair())
    # CURVE with no allow-list would authenticate nobody: refused unless said explicitly.
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, curve_public_key=pub, curve_secret_key=sec))
    with pytest.raises(RuntimeError, match="curve_clients_dir"):
        d.start()
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, curve_public_key=pub, curve_secret_key=sec,
                                       curve_allow_any_client=True))
    try:
        d.start()
        with WorkerClient(d.endpoint, timeout_s=10, curve_server_key=pub) as c:
            c.register(LAYOUT_A, worker_id="any")
    finally:
        d.stop()
    # A TCP bind other hosts can reach, without CURVE: refused unless allowed.
    (tmp_path / "b").mkdir()
    d = ServeProc(tmp_path / "b", daemon_cfg(tmp_path / "b", endpoint="tcp://0.0.0.0:*"))
    with pytest.raises(RuntimeError, match="allow_insecure_tcp"):
        d.start()
    d = ServeProc(tmp_path / "b", daemon_cfg(tmp_path / "b", endpoint="tcp://0.0.0.0:*", allow_insecure_tcp=True))
    try:
        d.start()
        assert d.info["endpoint"].startswith("tcp://0.0.0.0:")
    finally:
        d.stop()


# -- secrets never reach an output ---------------------------------------------------------------------------
FAKE = {"KVBM_S3_ACCESS_KEY": "AKIAFAKEACCESS00042", "KVBM_S3_SECRET_KEY": "fake-s3-secret-4242abcd",
        "KVBM_S3_SESSION_TOKEN": "fake-session-token-4242", "AWS_SECRET_ACCESS_KEY": "fake-aws-secret-4242zz",
        "KVBM_EMBEDDED_S3_SECRET_KEY": "fake-embedded-secret-4242"}


def test_repr_of_config_masks_every_secret():
    from kvbm.config import load_config

    cfg = load_config(environ={**FAKE, "KVBM_DAEMON_CURVE_SECRET_KEY": "fake-curve-secret-4242"})
    text = repr(cfg) + repr(cfg.s3) + str(cfg.embedded_s3) + repr(cfg.daemon)
    for secret in [*FAKE.values(), "fake-curve-secret-4242"]:
        assert secret not in text
    assert "secret_key=***" in repr(cfg.s3)


def test_no_secret_in_any_output_of_the_commands(weed_binary, tmp_path):
    """kvbm serve (its log), config show, status --json and s3 start/status with fake credentials in the
    environment: no output and no file written outside the credential files holds a secret."""
    d = ServeProc(tmp_path, daemon_cfg(tmp_path))
    cfg = json.loads(d.cfg_path.read_text())
    cfg["embedded_s3"] = {"dir": str(tmp_path / "weed")}
    d.cfg_path.write_text(json.dumps(cfg))
    d.start()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}, **FAKE, "KVBM_WEED": weed_binary}
    outs = []
    try:
        for args in (["config", "show"], ["config", "show", "--json"], ["status", "--json", "--direct"],
                     ["status", "--json"], ["s3", "status"]):
            r = kvbm_cli(*args, "--config", str(d.cfg_path), env=env)
            outs.append(r.stdout + r.stderr)
        # The embedded S3 without the fake secret: its own random one, which must not be printed either.
        env2 = {k: v for k, v in env.items() if k != "KVBM_EMBEDDED_S3_SECRET_KEY"}
        for args in (["s3", "start"], ["s3", "status"]):
            r = kvbm_cli(*args, "--config", str(d.cfg_path), env=env2)
            assert r.returncode == 0, r.stderr
            outs.append(r.stdout + r.stderr)
    finally:
        kvbm_cli("s3", "stop", "--timeout", "3", "--config", str(d.cfg_path), env=env)  # weed lingers 15 s on SIGTERM
        d.stop()
    ident = tmp_path / "weed" / "identity.json"
    assert stat.S_IMODE(ident.stat().st_mode) == 0o600
    weed_secret = json.loads(ident.read_text())["identities"][0]["credentials"][0]["secretKey"]
    assert weed_secret != "kvbm-local-secret" and len(weed_secret) >= 32
    secrets_ = [*FAKE.values(), d.admin_token(), weed_secret]
    files = [f for f in tmp_path.rglob("*") if f.is_file() and f.name not in ("identity.json", "admin.token")
             and f.stat().st_size < 50 << 20 and "disk" not in f.parts]
    for s in secrets_:
        for i, out in enumerate(outs):
            assert s not in out, (i, s)
        for f in files:
            assert s.encode() not in f.read_bytes(), (f, s)


def test_embedded_s3_secret_is_random_per_dir_and_reused(s3_server):
    from kvbm.s3server import EmbeddedS3

    assert s3_server.secret_key and s3_server.secret_key != "kvbm-local-secret"
    ident = s3_server.dir / "identity.json"
    assert stat.S_IMODE(ident.stat().st_mode) == 0o600
    again = EmbeddedS3(s3_server.dir, bucket=s3_server.bucket)  # no secret given: the dir's own
    again.start()
    try:
        assert again.reused and again.pid == s3_server.pid and again.secret_key == s3_server.secret_key
        assert s3_server.secret_key not in repr(again) + json.dumps(again.status())
    finally:
        again.stop()
    assert s3_server.running  # a reused server is left running


def test_daemon_log_lines_mask_secret_named_fields(capfd):
    import logging

    from kvbm.daemon import configure_logging, logj

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    # `kvbm bench` (run in-process by other tests) quiets the kvbm logger: this test needs INFO through.
    kvbm_log = logging.getLogger("kvbm")
    saved_kvbm = kvbm_log.level
    kvbm_log.setLevel(logging.NOTSET)
    try:
        for fmt in ("json", "text"):
            configure_logging(fmt)
            logj("s3.connect", endpoint="http://x", secret_key="fake-log-secret-1",
                 creds={"aws_secret_access_key": "fake-log-secret-2", "session_token": "fake-log-secret-3"})
            err = capfd.readouterr().err
            assert "s3.connect" in err and "http://x" in err, err
            assert "fake-log-secret" not in err, err
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        kvbm_log.setLevel(saved_kvbm)


def test_credential_files_and_bind_rules(tmp_path):
    from kvbm.config import DaemonConfig
    from kvbm.errors import ConfigError
    from kvbm.security import client_curve, ensure_admin_token, is_local_endpoint, read_admin_token

    path = tmp_path / "state" / "admin.token"
    token = ensure_admin_token(path)
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_admin_token(path) == token == read_admin_token(path)  # reused, never replaced
    assert read_admin_token(tmp_path / "none") == ""
    path.chmod(0o644)  # a token others can read is no credential: refused, not used
    with pytest.raises(ConfigError, match="chmod 600"):
        read_admin_token(path)
    local = ["ipc:///run/kvbm.sock", "tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:5557",
             "tcp://127.0.0.2:9"]
    remote = ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.5:5557", "tcp://eth0:5557", "tcp://[::]:1"]
    assert [is_local_endpoint(e) for e in local + remote] == [True] * len(local) + [False] * len(remote)
    with pytest.raises(ConfigError, match="curve_public_key"):
        client_curve(DaemonConfig(curve_client_key_file=str(tmp_path / "x.key_secret")))
