"""The ``http`` S3 body client (kvbm.tiers.s3.http) against a real SeaweedFS: byte-exact round trips,
metadata, corrupt/truncated/missing objects as misses, checksums off the event loop, cancellation that
never leaves a worker writing into the caller's buffer."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from needs import needs

from kvbm.blocks import BlockKey, encode_block
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.s3server import EmbeddedS3, s3_client
from kvbm.tiers import s3 as s3mod
from kvbm.tiers.s3 import HEADER_LEN, S3Tier, make_s3_tier
from kvbm.transfer import nixl_available

pytestmark = pytest.mark.s3

NS = "tiny-llama-0123456789abcdef"
MiB = 1024 * 1024
HAVE_NIXL, NIXL_WHY = nixl_available()
CLIENTS = ["aiobotocore", "http", pytest.param("nixl", marks=needs("nixl", HAVE_NIXL, f"s3.client nixl: {NIXL_WHY}"))]


def make_tier(srv: EmbeddedS3, prefix: str, client: str = "http", **over) -> S3Tier:
    cfg = S3Config(bucket=srv.bucket, prefix=prefix, client=client, **over)
    return make_s3_tier(cfg, srv.endpoint, (srv.access_key, srv.secret_key))


def key(i: int) -> BlockKey:
    return BlockKey(NS, i.to_bytes(4, "big") + os.urandom(12))


def test_roundtrip_sizes_byte_exact_with_metadata(s3_server, s3_prefix):
    """Tiny, 1 MiB and 8 MiB blocks come back byte-exact; objects carry the kvbm metadata and are readable
    by plain S3 clients as ``header || payload``."""
    sizes = [1, 100, MiB, 8 * MiB]

    async def run():
        t = make_tier(s3_server, s3_prefix, max_concurrency=4)
        await t.start()
        try:
            assert t.describe()["client"] == "http"
            keys = [key(i) for i in range(len(sizes))]
            blobs = [os.urandom(n) for n in sizes]
            await asyncio.gather(*(t.put(k, b) for k, b in zip(keys, blobs, strict=True)))
            assert t.stats.puts == len(sizes) and t.stats.errors == 0
            outs = [bytearray(n + 7) for n in sizes]  # larger than the block: only n bytes written
            got = await asyncio.gather(*(t.get_into(k, memoryview(o)) for k, o in zip(keys, outs, strict=True)))
            assert got == sizes
            assert all(bytes(o[:n]) == b and o[n:] == bytearray(7)
                       for o, b, n in zip(outs, blobs, sizes, strict=True))
            # Again, on the kept-alive connections.
            assert [await t.get(k) for k in keys] == blobs
            assert t.stats.hits == 2 * len(sizes) and t.stats.corrupt == 0
            return [t.object_key(k) for k in keys], keys, blobs
        finally:
            await t.close()

    okeys, keys, blobs = asyncio.run(run())
    cli = s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    for okey, k, b in zip(okeys, keys, blobs, strict=True):
        obj = cli.get_object(Bucket=s3_server.bucket, Key=okey)
        assert obj["Metadata"]["kvbm-namespace"] == NS
        assert obj["Metadata"]["kvbm-hash"] == k.hash.hex()
        assert obj["Metadata"]["kvbm-nbytes"] == str(len(b))
        assert obj["Metadata"]["kvbm-format"] == s3mod.META_FORMAT
        body = obj["Body"].read()
        assert len(body) == HEADER_LEN + len(b) and body[HEADER_LEN:] == b


def test_corrupt_truncated_and_missing_objects_are_misses(s3_server, s3_prefix):
    """Objects written around kvbm (plain botocore): a flipped byte, a cut body, a body shorter than the
    header and another block's body are counted corrupt misses and deleted; a missing object is a plain
    miss. None of them is an error or opens the breaker."""
    cli = s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)

    async def run():
        t = make_tier(s3_server, s3_prefix)
        await t.start()
        try:
            good = os.urandom(MiB)
            cases = {}
            k = key(1)
            body = bytearray(encode_block(k, good))
            body[HEADER_LEN + 12345] ^= 0x01
            cases[k] = bytes(body)
            k = key(2)
            cases[k] = encode_block(k, good)[: HEADER_LEN + MiB // 2]  # truncated
            k = key(3)
            cases[k] = encode_block(k, good)[:50]  # not even a header
            k = key(4)
            cases[k] = encode_block(key(5), good)  # another block's body
            for k, b in cases.items():
                cli.put_object(Bucket=s3_server.bucket, Key=t.object_key(k), Body=b)
            out = bytearray(MiB)
            for i, k in enumerate(cases, 1):
                assert await t.get_into(k, memoryview(out)) is None, k
                assert t.stats.corrupt == i and not t.contains(k)
                assert (await t.head_many([k]))[k] is None  # deleted
            missing = key(9)
            assert await t.get_into(missing, memoryview(out)) is None
            assert t.stats.corrupt == len(cases) and t.stats.misses == len(cases) + 1
            assert t.stats.errors == 0 and t.breaker.state == "closed" and t.stats.hits == 0
            # The connections are fine afterwards.
            k = key(6)
            await t.put(k, good)
            assert await t.get_into(k, memoryview(out)) == MiB and bytes(out) == good
        finally:
            await t.close()

    asyncio.run(run())


@pytest.mark.parametrize("client", CLIENTS)
def test_checksums_run_off_the_event_loop(s3_server, s3_prefix, client, monkeypatch):
    """The xxh3 of an 8 MiB body (PUT: header; GET: verification) never runs on the event loop's thread."""
    import kvbm.blocks.format as blocks  # where checksum lives (and is looked up by pack_header and verify)

    threads: list[tuple[str, int]] = []
    real = blocks.checksum

    def spy(data):
        if memoryview(data).nbytes >= MiB:
            threads.append(("sum", threading.get_ident()))
        return real(data)

    monkeypatch.setattr(blocks, "checksum", spy)

    async def run():
        loop_thread = threading.get_ident()
        t = make_tier(s3_server, s3_prefix, client)
        await t.start()
        try:
            k, data = key(1), os.urandom(8 * MiB)
            await t.put(k, data)
            out = bytearray(8 * MiB)
            assert await t.get_into(k, memoryview(out)) == 8 * MiB and bytes(out) == data
        finally:
            await t.close()
        return loop_thread

    loop_thread = asyncio.run(run())
    assert len(threads) == 2, threads  # once on PUT, once on GET
    assert all(tid != loop_thread for _, tid in threads), "an 8 MiB checksum ran on the event loop"


def test_cancelled_get_never_writes_after_returning(s3_server, s3_prefix):
    """A GET cancelled mid-body returns only once its worker has stopped touching the caller's buffer
    (the buffer is a G2 slot that the manager reuses right away)."""

    async def run():
        t = make_tier(s3_server, s3_prefix, max_concurrency=2)
        await t.start()
        try:
            k, data = key(1), os.urandom(8 * MiB)
            await t.put(k, data)
            for _ in range(5):
                out = bytearray(8 * MiB)
                task = asyncio.ensure_future(t.get_into(k, memoryview(out)))
                await asyncio.sleep(0.002)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                snap = bytes(out)
                # Let any stray worker run; the buffer must not change any more.
                await asyncio.sleep(0.2)
                assert bytes(out) == snap
            got = bytearray(8 * MiB)
            assert await t.get_into(k, memoryview(got)) == 8 * MiB and bytes(got) == data
        finally:
            await t.close()

    asyncio.run(run())


def test_wrong_credentials_clear_error(s3_server, s3_prefix):
    async def run():
        for creds in ((s3_server.access_key, "wrong-secret"), ("nobody", "nothing")):
            cfg = S3Config(bucket=s3_server.bucket, prefix=s3_prefix, client="http", max_retries=0)
            t = make_s3_tier(cfg, s3_server.endpoint, creds)
            with pytest.raises(ConfigError, match=f"S3 credentials rejected by {s3_server.endpoint}") as ei:
                await t.start()
            assert "wrong-secret" not in str(ei.value) and "\n" not in str(ei.value)

    asyncio.run(run())


def test_signer_sends_unsigned_payload_unless_asked(s3_server, s3_prefix, monkeypatch):
    """The server accepts both forms; with ``sign_payload`` the body's SHA-256 is what is signed."""
    import hashlib

    from kvbm.tiers.s3 import http as s3_http

    seen: list[str] = []
    real = s3_http.HttpBodyClient._sign

    def spy(self, method, path, creds, headers, sha):
        out = real(self, method, path, creds, headers, sha)
        if method == "PUT":
            seen.append(out["X-Amz-Content-SHA256"])
        return out

    monkeypatch.setattr(s3_http.HttpBodyClient, "_sign", spy)
    data = os.urandom(300_000)

    async def run(sign: bool):
        t = make_tier(s3_server, s3_prefix, sign_payload=sign)
        await t.start()
        try:
            k = key(1)
            await t.put(k, data)
            assert await t.get(k) == data
            return t.object_key(k)
        finally:
            await t.close()

    cli = s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    asyncio.run(run(False))
    assert seen[-1] == "UNSIGNED-PAYLOAD"
    seen.clear()
    okey = asyncio.run(run(True))
    stored = cli.get_object(Bucket=s3_server.bucket, Key=okey)["Body"].read()
    assert seen[-1] == hashlib.sha256(stored).hexdigest()


async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, first: bytes = b"") -> None:
    """Copy ``first`` then everything from ``r`` to ``w`` until EOF (one direction of a test proxy)."""
    try:
        if first:
            w.write(first)
        while data := await r.read(1 << 20):
            w.write(data)
            await w.drain()
    except Exception:
        pass
    finally:
        w.close()


class _LoopbackProxy:
    """A proxy to ``target`` (an http URL) serving on a loopback port from its own thread and event loop;
    subclasses start their server in :meth:`_run`, set ``port`` and ``_ready``, then run the loop."""

    def __init__(self, target: str, name: str) -> None:
        from urllib.parse import urlsplit

        u = urlsplit(target)
        self.target = (u.hostname, u.port)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class _TlsProxy(_LoopbackProxy):
    """A TLS terminator in front of the plain-http SeaweedFS (a real TLS endpoint; bytes pass unchanged)."""

    def __init__(self, target: str, cert: str, keyfile: str) -> None:
        super().__init__(target, "tls-proxy")
        self.cert, self.keyfile = cert, keyfile
        self.accepted = 0

    def _run(self) -> None:
        import ssl

        asyncio.set_event_loop(self.loop)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.keyfile)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.accepted += 1
            ur, uw = await asyncio.open_connection(*self.target)
            await asyncio.gather(pipe(r, uw), pipe(ur, w))

        server = self.loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()



def test_https_endpoint_with_default_ssl_context(s3_server, s3_prefix, tmp_path, monkeypatch):
    """An https endpoint goes through TLS with certificate verification (the CA trusted via SSL_CERT_FILE /
    AWS_CA_BUNDLE, as an operator would); a certificate nobody trusts fails the start clearly."""
    import subprocess

    cert, keyfile = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", keyfile, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)

    async def run(endpoint: str) -> None:
        cfg = S3Config(bucket=s3_server.bucket, prefix=s3_prefix, client="http", max_retries=0)
        t = make_s3_tier(cfg, endpoint, (s3_server.access_key, s3_server.secret_key))
        await t.start()
        try:
            k, data = key(1), os.urandom(3 * MiB + 5)
            await t.put(k, data)
            out = bytearray(len(data))
            assert await t.get_into(k, memoryview(out)) == len(data) and bytes(out) == data
            assert t.stats.errors == 0
        finally:
            await t.close()

    with _TlsProxy(s3_server.endpoint, cert, keyfile) as proxy:
        endpoint = f"https://localhost:{proxy.port}"
        # Trusted by botocore (control calls) only: the http client's own verification refuses the start.
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)
        with pytest.raises(TierUnavailableError, match=r"S3 http client cannot use .*CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(run(endpoint))
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        before = proxy.accepted
        asyncio.run(run(endpoint))
        assert proxy.accepted > before


class _SlowDownProxy(_LoopbackProxy):
    """Pipes to SeaweedFS, but answers the next ``faults`` requests itself with 503 SlowDown (throttling,
    which SeaweedFS on loopback never produces) and closes those connections."""

    def __init__(self, target: str) -> None:
        super().__init__(target, "slowdown-proxy")
        self.faults = 0
        self.answered = 0
        self._open: set[asyncio.StreamWriter] = set()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            head = await r.readuntil(b"\r\n\r\n")
            if self.faults > 0 and head.startswith(b"GET "):
                self.faults -= 1
                self.answered += 1
                body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                w.write(b"HTTP/1.1 503 Slow Down\r\nConnection: close\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await w.drain()
                w.close()
                return
            ur, uw = await asyncio.open_connection(*self.target)
            self._open.add(w)
            try:
                await asyncio.gather(pipe(r, uw, head), pipe(ur, w))
            finally:
                self._open.discard(w)

        server = self.loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    def arm(self, faults: int) -> None:
        """Answer the next ``faults`` GETs with 503; idle kept-alive connections are closed so that the
        next requests come on new ones (which the client must survive too)."""

        def go() -> None:
            self.faults = faults
            for w in list(self._open):
                w.close()

        self.loop.call_soon_threadsafe(go)



def test_throttling_is_retried_with_backoff_then_an_error(s3_server, s3_prefix):
    """503 SlowDown is retried up to ``s3.max_retries`` times (the block arrives, no error counted); beyond
    that the GET fails as an error (a miss, counted, feeding the breaker), not as a corrupt object."""

    async def run(proxy: _SlowDownProxy) -> None:
        cfg = S3Config(bucket=s3_server.bucket, prefix=s3_prefix, client="http", max_retries=2,
                       max_concurrency=1, breaker_failures=5)
        t = make_s3_tier(cfg, f"http://127.0.0.1:{proxy.port}", (s3_server.access_key, s3_server.secret_key))
        await t.start()
        try:
            k, data = key(1), os.urandom(MiB)
            await t.put(k, data)
            out = bytearray(MiB)
            proxy.arm(2)
            await asyncio.sleep(0.2)  # let the proxy close the idle connections
            assert await t.get_into(k, memoryview(out)) == MiB and bytes(out) == data
            assert proxy.answered == 2 and t.stats.errors == 0 and t.breaker.consecutive == 0
            proxy.arm(3)
            await asyncio.sleep(0.2)
            assert await t.get_into(k, memoryview(out)) is None
            assert proxy.answered == 5 and t.stats.errors == 1 and t.stats.corrupt == 0 and t.contains(k)
            assert await t.get_into(k, memoryview(out)) == MiB and bytes(out) == data
        finally:
            await t.close()

    with _SlowDownProxy(s3_server.endpoint) as proxy:
        asyncio.run(run(proxy))


def test_credentials_from_the_aws_chain(s3_server, s3_prefix, tmp_path, monkeypatch):
    """No credentials in the config or the tier: the http client signs with what botocore's chain resolves
    (here a shared credentials file), like the aiobotocore control client; the secret is never logged."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {s3_server.access_key}\n"
                     f"aws_secret_access_key = {s3_server.secret_key}\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))

    async def run() -> None:
        t = S3Tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix, client="http"), endpoint=s3_server.endpoint)
        await t.start()
        try:
            k, data = key(1), os.urandom(2 * MiB)
            await t.put(k, data)
            assert await t.get(k) == data and t.stats.errors == 0
            assert s3_server.secret_key not in repr(t.describe())
        finally:
            await t.close()

    asyncio.run(run())
