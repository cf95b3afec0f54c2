"""G4 S3 tier against a real SeaweedFS: both data paths, integrity, failures, batch operations."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
from needs import needs, require

from kvbm.blocks import BlockKey
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError, WriteShedError
from kvbm.s3server import EmbeddedS3, pick_ports
from kvbm.tiers.s3 import HEADER_LEN, CircuitBreaker, S3Tier, make_s3_tier
from kvbm.transfer import nixl_available

pytestmark = pytest.mark.s3

NS = "tiny-llama-0123456789abcdef"
NS2 = "other-model-fedcba9876543210"
MiB = 1024 * 1024
HAVE_NIXL, NIXL_WHY = nixl_available()
NIXL = pytest.param("nixl", marks=needs("nixl", HAVE_NIXL, f"s3.client nixl: {NIXL_WHY}"))
CLIENTS = ["aiobotocore", "http", NIXL]


def make_tier(srv: EmbeddedS3, prefix: str, client: str = "aiobotocore", *, bucket: str | None = None,
              credentials: tuple[str, str] | None = None, endpoint: str | None = None, **over) -> S3Tier:
    cfg = S3Config(bucket=bucket or srv.bucket, prefix=prefix, client=client, **over)
    return make_s3_tier(cfg, endpoint or srv.endpoint, credentials or (srv.access_key, srv.secret_key))


def key(i: int, ns: str = NS) -> BlockKey:
    return BlockKey(ns, i.to_bytes(4, "big") + os.urandom(12))


@pytest.mark.parametrize("client", CLIENTS)
def test_roundtrip_8mib(s3_server, s3_prefix, client):
    async def run():
        t = make_tier(s3_server, s3_prefix, client, max_concurrency=4)
        await t.start()
        try:
            keys = [key(i) for i in range(6)]
            blobs = [os.urandom(8 * MiB) for _ in keys]
            t0 = time.perf_counter()
            await asyncio.gather(*(t.put(k, b) for k, b in zip(keys, blobs, strict=True)))
            put_s = time.perf_counter() - t0
            assert t.stats.puts == len(keys) and t.stats.errors == 0
            assert all(t.nbytes(k) == 8 * MiB for k in keys)
            assert t.used_bytes() == len(keys) * (8 * MiB + HEADER_LEN)
            outs = [bytearray(8 * MiB) for _ in keys]
            t0 = time.perf_counter()
            got = await asyncio.gather(*(t.get_into(k, memoryview(o)) for k, o in zip(keys, outs, strict=True)))
            get_s = time.perf_counter() - t0
            assert got == [8 * MiB] * len(keys)
            assert all(bytes(o) == b for o, b in zip(outs, blobs, strict=True))
            assert await t.get(keys[0]) == blobs[0]
            assert await t.get(key(99)) is None  # not indexed: a miss without I/O
            out = bytearray(8 * MiB)
            assert await t.get_into(key(98), memoryview(out)) is None  # not there: a miss
            absent = key(97)
            heads = await t.head_many([keys[0], absent])
            assert heads[absent] is None
            h = heads[keys[0]]
            assert h["size"] == 8 * MiB + HEADER_LEN and h["nbytes"] == 8 * MiB
            if client != "nixl":
                assert h["metadata"]["kvbm-namespace"] == NS
                assert h["metadata"]["kvbm-hash"] == keys[0].hash.hex()
                assert h["metadata"]["kvbm-nbytes"] == str(8 * MiB)
            assert await t.delete(keys[0]) is True
            assert not t.contains(keys[0]) and await t.delete(keys[0]) is False
            mb = len(keys) * 8
            print(f"\n{client}: PUT {mb / put_s:.0f} MB/s, GET {mb / get_s:.0f} MB/s ({len(keys)} x 8 MiB)")
        finally:
            await t.close()

    asyncio.run(run())


def test_key_scheme(s3_server):
    t = S3Tier(S3Config(prefix="kv/", shard_chars=2))
    k = BlockKey(NS, bytes.fromhex("abcdef01"))
    assert t.object_key(k) == f"kv/{NS}/ab/abcdef01"
    assert t.parse_key(t.object_key(k)) == k
    for foreign in ("kv/README", f"kv/{NS}/zz/abcdef01", f"kv/{NS}/ab/xyz", "other/x/ab/abcdef01",
                    "kv/nofingerprint/ab/abcdef01"):
        assert t.parse_key(foreign) is None
    t0 = S3Tier(S3Config(prefix="", shard_chars=0))
    assert t0.object_key(k) == f"{NS}/abcdef01" and t0.parse_key(f"{NS}/abcdef01") == k


@pytest.mark.parametrize("b_client", ["http", NIXL])
def test_cross_node_reuse(s3_server, s3_prefix, b_client):
    async def run():
        a = make_tier(s3_server, s3_prefix)
        await a.start()
        keys = [key(i) for i in range(4)]
        blobs = [os.urandom(64 * 1024) for _ in keys]
        for k, b in zip(keys, blobs, strict=True):
            await a.put(k, b)
        b_node = make_tier(s3_server, s3_prefix, b_client, scan_on_start=True)  # another node, other data path
        await b_node.start()  # scan_on_start fills the index from the bucket
        try:
            assert all(b_node.nbytes(k) == 64 * 1024 for k in keys)
            assert [await b_node.get(k) for k in keys] == blobs
            late = key(50)
            await a.put(late, b"late" * 100)
            out = bytearray(400)
            assert await b_node.get_into(late, memoryview(out)) == 400 and bytes(out) == b"late" * 100
            assert b_node.contains(late)
        finally:
            await a.close()
            await b_node.close()

    asyncio.run(run())


@pytest.mark.parametrize("client", CLIENTS)
def test_corrupt_object_is_a_counted_miss(s3_server, s3_prefix, client):
    async def run():
        t = make_tier(s3_server, s3_prefix, client)
        await t.start()
        try:
            k, k2 = key(1), key(2)
            await t.put(k, os.urandom(4096))
            await t.put(k2, os.urandom(4096))
            okey = t.object_key(k)
            body = bytearray(await (await t.session.client.get_object(Bucket=t.bucket, Key=okey))["Body"].read())
            body[HEADER_LEN + 100] ^= 0xFF  # one flipped payload byte, same size
            await t.session.client.put_object(Bucket=t.bucket, Key=okey, Body=bytes(body))
            out = bytearray(4096)
            assert await t.get_into(k, memoryview(out)) is None
            assert t.stats.corrupt == 1 and not t.contains(k)
            assert (await t.head_many([k]))[k] is None  # deleted
            # A body that is another block's (header names a different hash) is corrupt too.
            other = await (await t.session.client.get_object(Bucket=t.bucket, Key=t.object_key(k2)))["Body"].read()
            await t.session.client.put_object(Bucket=t.bucket, Key=okey, Body=other)
            assert await t.get_into(k, memoryview(out)) is None and t.stats.corrupt == 2
        finally:
            await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("client", CLIENTS)
def test_wrong_credentials_clear_error(s3_server, s3_prefix, client):
    async def run():
        for creds in ((s3_server.access_key, "wrong-secret"), ("nobody", "nothing")):
            t = make_tier(s3_server, s3_prefix, client, credentials=creds, max_retries=0)
            with pytest.raises(ConfigError, match=f"S3 credentials rejected by {s3_server.endpoint}") as ei:
                await t.start()
            assert "wrong-secret" not in str(ei.value) and "\n" not in str(ei.value)

    asyncio.run(run())


def test_bucket_missing_created_and_unreachable(s3_server, s3_prefix, s3_bucket):
    async def run():
        t = make_tier(s3_server, s3_prefix, bucket=s3_bucket, create_bucket=False)
        with pytest.raises(ConfigError, match=f"bucket '{s3_bucket}' does not exist"):
            await t.start()
        t = make_tier(s3_server, s3_prefix, bucket=s3_bucket)  # create_bucket: true
        await t.start()
        try:
            k = key(1)
            await t.put(k, b"x" * 1000)
            assert await t.get(k) == b"x" * 1000
        finally:
            await t.close()
        dead = f"http://127.0.0.1:{pick_ports(1)[0]}"
        t = make_tier(s3_server, s3_prefix, endpoint=dead, max_retries=0, connect_timeout_s=0.5)
        with pytest.raises(TierUnavailableError, match=f"S3 endpoint {dead} unreachable"):
            await t.start()

    asyncio.run(run())


def test_listing_paging_batch_delete_usage(s3_server, s3_prefix):
    n1, n2 = 1050, 30

    async def run():
        t = make_tier(s3_server, s3_prefix, max_concurrency=16, max_pending_writes=2000)
        await t.start()
        try:
            blob = os.urandom(1024)
            k1 = [key(i) for i in range(n1)]
            k2 = [key(i, NS2) for i in range(n2)]
            await asyncio.gather(*(t.put(k, blob) for k in k1 + k2))
            assert t.stats.puts == n1 + n2 and t.stats.shed == 0
            await t.session.client.put_object(Bucket=t.bucket, Key=f"{s3_prefix}/README", Body=b"foreign")
            listed = [x async for x in t.list_objects()]
            assert len(listed) == n1 + n2 + 1
            assert sum(1 for bk, *_ in listed if bk is None) == 1
            assert {bk for bk, *_ in listed if bk is not None} == set(k1 + k2)
            assert all(size == 1024 + HEADER_LEN for bk, _, size, _ in listed if bk is not None)
            assert len([x async for x in t.list_objects(namespace=NS2)]) == n2
            assert len([x async for x in t.list_objects(key_prefix="other-")]) == n2
            # A fresh node's scan sees everything (and ignores the foreign key).
            t2 = make_tier(s3_server, s3_prefix)
            await t2.start()
            blocks = [b async for b in t2.scan()]
            assert len(blocks) == n1 + n2 and t2.used_bytes() == (n1 + n2) * (1024 + HEADER_LEN)
            await t2.close()
            use = await t.usage()
            assert set(use) == {NS, NS2}
            assert use[NS]["objects"] == n1 and use[NS]["bytes"] == n1 * (1024 + HEADER_LEN)
            assert use[NS2]["objects"] == n2 and use[NS2]["oldest"] <= use[NS2]["newest"]
            deleted, errors = await t.delete_many([s3k async for _, s3k, _, _ in t.list_objects(namespace=NS)])
            assert (deleted, errors) == (n1, [])
            assert not any(t.contains(k) for k in k1) and all(t.contains(k) for k in k2)
            assert set(await t.usage()) == {NS2}
            assert len([x async for x in t.list_objects()]) == n2 + 1
        finally:
            await t.close()

    asyncio.run(run())


def test_circuit_breaker_states():
    now = [0.0]
    b = CircuitBreaker(2, 5.0, clock=lambda: now[0])
    assert b.allow()
    b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 5.1
    assert b.allow() and b.state == "half-open"
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 10.2
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_endpoint_killed_then_recovers(weed_binary, tmp_path):
    """A dedicated server is killed mid-run: reads miss, writes are shed (both data paths); a restart on
    the same dir and port brings the tiers back without restarting them."""
    require("nixl", HAVE_NIXL, f"the outage runs the three S3 clients together, nixl among them: {NIXL_WHY}")
    srv = EmbeddedS3(tmp_path / "sw", weed=weed_binary, bucket="kvbm-outage", stop_timeout_s=1.0, reuse=False)
    opts = dict(breaker_failures=2, breaker_reset_s=3.0, max_retries=0, connect_timeout_s=0.5,
                read_timeout_s=5.0, nixl_timeout_s=1.5)

    async def run():
        tiers = [make_tier(srv, f"p-{c}", c, **opts) for c in ("aiobotocore", "http", "nixl")]
        keys = [key(i) for i in range(3)]
        try:
            for t in tiers:
                await t.start()
                for k in keys:
                    await t.put(k, k.hash * 4096)
                assert await t.get(keys[0]) == keys[0].hash * 4096
            port = srv.port
            srv.stop(force=True)  # SIGKILL: the endpoint vanishes mid-run
            out = bytearray(64 * 1024)

            shed_keys = [key(100 + i) for i in range(5)]
            for t in tiers:
                for k in keys[:2]:
                    assert await t.get_into(k, memoryview(out)) is None
                assert t.breaker.state == "open" and t.stats.errors >= 2, t.client_kind
                t0 = time.perf_counter()
                errors, misses = t.stats.errors, t.stats.misses
                assert await t.get_into(keys[2], memoryview(out)) is None
                for k in shed_keys:
                    # A shed write raises: no caller may take it for a stored block.
                    with pytest.raises(WriteShedError, match="circuit breaker open"):
                        await t.put(k, b"y" * 1000)
                # No I/O while open: the read is a miss and the writes are shed, none of them an error
                # (any request to the dead endpoint would have failed and counted one).
                assert t.stats.errors == errors and t.stats.misses == misses + 1 and t.breaker.state == "open"
                assert t.stats.shed == 5 and not any(t.contains(k) for k in shed_keys)
                assert t.describe()["breaker"] == {"state": "open", "opens": 1, "consecutive": t.breaker.consecutive}
            srv.port = port
            srv.start()
            assert srv.port == port
            await asyncio.sleep(max(0.0, 3.1 - (time.perf_counter() - t0)))
            for t in tiers:
                # Half-open probe; stale pooled connections may fail the first attempts.
                for _ in range(20):
                    if await t.get_into(keys[1], memoryview(out)) is not None:
                        break
                    await asyncio.sleep(0.6)
                assert t.breaker.state == "closed", t.client_kind
                assert bytes(out[: 16 * 4096]) == keys[1].hash * 4096
                fresh = key(200)
                await t.put(fresh, b"z" * 1000)
                assert await t.get(fresh) == b"z" * 1000
        finally:
            for t in tiers:
                await t.close()

    try:
        srv.start()
        asyncio.run(run())
    finally:
        srv.stop(force=True)


@pytest.mark.parametrize("sign_payload", [False, True])
def test_put_bodies_are_unsigned_unless_asked(s3_server, s3_prefix, sign_payload):
    """kvbm's own checksum guards the body, so SigV4's SHA-256 of it is skipped unless configured."""
    import hashlib

    async def run():
        t = make_tier(s3_server, s3_prefix, sign_payload=sign_payload)
        await t.start()
        sent: list[tuple[bytes, str]] = []

        def capture(request, **kw):
            body = bytes(request.body) if isinstance(request.body, (bytes, bytearray, memoryview)) else b""
            sent.append((request.headers["X-Amz-Content-SHA256"], hashlib.sha256(body).hexdigest()))

        t.session.client.meta.events.register("before-send.s3.PutObject", capture)
        data = os.urandom(256 * 1024)
        k = key(1)
        await t.put(k, data)
        assert t.stats.puts == 1 and t.stats.errors == 0  # the server accepted the request
        assert await t.get(k) == data
        await t.close()
        return sent

    sent = asyncio.run(run())
    assert len(sent) == 1
    header, body_sha = sent[0]
    assert header == (body_sha.encode() if sign_payload else b"UNSIGNED-PAYLOAD")


def test_list_pages_is_the_shared_tier_interface(s3_server, s3_prefix):
    """What the fleet reads (members, access logs) is a public method of the shared-tier interface: pages of
    (key, object key, size, last-modified), foreign objects with key None."""
    from kvbm.tiers.base import SharedTier

    async def run():
        t = make_tier(s3_server, s3_prefix, "http")
        await t.start()
        try:
            assert isinstance(t, SharedTier)
            keys = [key(i) for i in range(3)]
            for k in keys:
                await t.put(k, b"x" * 100)
            await t.put_aux(f"{s3_prefix}/{NS}/zz/not-a-block", b"foreign")
            rows = [row async for page in t.list_pages(f"{s3_prefix}/{NS}/") for row in page]
            assert {(r[0], r[2]) for r in rows if r[0] is not None} == {(k, 100 + HEADER_LEN) for k in keys}
            assert [r[1] for r in rows if r[0] is None] == [f"{s3_prefix}/{NS}/zz/not-a-block"]
            assert all(r[3] is not None for r in rows)
        finally:
            await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("client", ["http", NIXL])
def test_body_clients_re_read_rotated_credentials(s3_server, s3_prefix, tmp_path, monkeypatch, client):
    """Credentials from botocore's chain that expire (a credential_process stating an Expiration) are re-read by the
    body client before each transfer, NIXL's included (issue 37 D16: it kept the snapshot it started with). The
    rotation goes to a wrong secret and back: each write uses what the source says at that moment."""
    state = tmp_path / "current.json"
    script = tmp_path / "creds.py"
    script.write_text(
        "import datetime, json, sys\n"
        f"c = json.load(open({str(state)!r}))\n"
        "exp = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)\n"
        "json.dump({'Version': 1, 'AccessKeyId': c['ak'], 'SecretAccessKey': c['sk'],"
        " 'Expiration': exp.isoformat()}, sys.stdout)\n")
    (tmp_path / "config").write_text(f"[default]\ncredential_process = {sys.executable} {script}\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))

    def rotate(secret: str) -> None:
        state.write_text(json.dumps({"ak": s3_server.access_key, "sk": secret}))

    async def run() -> None:
        rotate(s3_server.secret_key)
        # No credentials given: the tier resolves botocore's chain (5 minutes from expiry: refreshed on each use).
        t = S3Tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix, client=client, nixl_timeout_s=10.0,
                            max_retries=0), endpoint=s3_server.endpoint)
        await t.start()
        try:
            k1, k2, k3 = key(1), key(2), key(3)
            await t.put(k1, os.urandom(MiB))
            rotate("not-the-secret")
            with pytest.raises(TierUnavailableError):
                await t.put(k2, os.urandom(MiB))
            rotate(s3_server.secret_key)
            data = os.urandom(MiB)
            await t.put(k3, data)
            assert await t.get(k3) == data
        finally:
            await t.close()

    asyncio.run(run())
