"""An HTTP fault proxy on loopback between the daemon and its S3 endpoint (SeaweedFS).

Each request is read whole (head and ``Content-Length`` or chunked body) and then, per a seeded draw,
forwarded as is, delayed, answered ``500 InternalError`` or ``503 SlowDown`` without reaching S3, cut by a
connection reset (before or after S3 saw it), or forwarded with its response body truncated and the
connection closed. :meth:`FaultProxy.outage` refuses every connection and request for some seconds.

The draw of request ``n`` is ``Random(f"{seed}:{n}")``: the same seed gives the same faults in the same
order of requests (which requests the daemon sends, and when, still depends on timing). The proxy runs its own
event loop in a thread so a blocking harness can drive it; :attr:`FaultProxy.counts` says what it injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

FAULTS = ("latency", "error500", "slowdown503", "reset", "truncate")
_HEAD_MAX = 64 * 1024


@dataclass
class FaultRates:
    """Probability of each fault per request (the rest are forwarded untouched)."""

    latency: float = 0.0
    error500: float = 0.0
    slowdown503: float = 0.0
    reset: float = 0.0
    truncate: float = 0.0
    latency_s: tuple[float, float] = (0.05, 0.5)
    methods: tuple[str, ...] = ()  # only requests of these HTTP methods are faulted (empty: every request)
    target_has: str = ""  # only requests whose target (path and query) holds this, e.g. one namespace's blocks

    def pick(self, rng: random.Random) -> str:
        x = rng.random()
        for kind in FAULTS:
            x -= getattr(self, kind)
            if x < 0:
                return kind
        return ""


@dataclass
class _Request:
    head: bytes
    body: bytes
    method: str


@dataclass
class ProxyCounts:
    requests: int = 0
    forwarded: int = 0
    injected: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise ConnectionError("HTTP head too large") from None


def _headers(head: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        if b":" in line:
            k, v = line.split(b":", 1)
            out[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return out


async def _read_body(reader: asyncio.StreamReader, hdrs: dict[str, str], *, response_to: str = "",
                     status: int = 200) -> bytes:
    """The body framed by ``hdrs`` (Content-Length or chunked, raw as sent); none for HEAD, 1xx, 204, 304."""
    if response_to == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return b""
    if "chunked" in hdrs.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            out += line
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers up to the empty line
                    t = await reader.readuntil(b"\r\n")
                    out += t
                    if t == b"\r\n":
                        return bytes(out)
            out += await reader.readexactly(size + 2)
    n = int(hdrs.get("content-length", "0") or 0)
    if n == 0 and response_to and "content-length" not in hdrs:
        return await reader.read()  # a response framed by the connection's close
    return await reader.readexactly(n)


def _faulted(rates: FaultRates, req: _Request) -> bool:
    """Whether ``req`` is one ``rates`` may fault (its method, its target)."""
    if rates.methods and req.method not in rates.methods:
        return False
    if rates.target_has:
        target = req.head.split(b"\r\n", 1)[0].split(b" ")
        return len(target) > 1 and rates.target_has.encode() in target[1]
    return True


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0): the peer sees 'connection reset by peer'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _error_response(status: int, code: str, message: str) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>kvbm-chaos</RequestId></Error>").encode()
    reason = {500: "Internal Server Error", 503: "Slow Down"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"x-amz-request-id: kvbm-chaos\r\n\r\n").encode() + body


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (host, port), injecting faults per :attr:`rates`."""

    def __init__(self, upstream: tuple[str, int], seed: int = 0) -> None:
        self.upstream = upstream
        self.seed = seed
        self.rates = FaultRates()
        self.counts = ProxyCounts()
        self.port = 0
        self._down_until = 0.0
        self._n = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control (from any thread) --------------------------------------------------------------------
    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            self._server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0,
                                                                        limit=_HEAD_MAX))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            for w in list(self._conns):
                w.transport.abort()
            # Requests still sleeping out an injected latency end here, before the loop closes (destroyed pending,
            # their cleanup would run on a closed loop).
            pending = asyncio.all_tasks(loop)
            for t in pending:
                t.cancel()
            if pending:  # (gather of nothing looks for a current loop, which this thread does not set)
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def outage(self, seconds: float) -> None:
        """Refuse every request (reset its connection) for ``seconds`` from now; open connections are cut."""
        self._down_until = time.monotonic() + seconds
        self.counts.add("outage")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cut_all)

    def heal(self) -> None:
        """No more faults: end any outage, forward everything."""
        self._down_until = 0.0
        self.rates = FaultRates()

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    # -- the proxy (its loop) ---------------------------------------------------------------------------
    def _cut_all(self) -> None:
        for w in list(self._conns):
            _abort(w)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down():
            _abort(writer)
            return
        self._conns.add(writer)
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                req = await self._read_request(reader, writer)
                if req is None:
                    return
                if self.down():
                    _abort(writer)
                    return
                rng = random.Random(f"{self.seed}:{self._n}")
                self._n += 1
                self.counts.requests += 1
                rates = self.rates
                kind = rates.pick(rng) if _faulted(rates, req) else ""
                if kind:
                    self.counts.add(kind)
                if kind == "latency":
                    await asyncio.sleep(rng.uniform(*self.rates.latency_s))
                elif kind in ("error500", "slowdown503"):
                    status, code = (500, "InternalError") if kind == "error500" else (503, "SlowDown")
                    writer.write(_error_response(status, code, "injected by kvbm chaos"))
                    await writer.drain()
                    continue
                elif kind == "reset" and rng.random() < 0.5:
                    _abort(writer)  # before S3 saw it
                    return
                if up is None:
                    up = await asyncio.open_connection(*self.upstream, limit=_HEAD_MAX)
                up[1].write(req.head + req.body)
                await up[1].drain()
                head = await _read_head(up[0])
                if head is None:
                    _abort(writer)
                    return
                status = int(head.split(b" ", 2)[1])
                hdrs = _headers(head)
                body = await _read_body(up[0], hdrs, response_to=req.method, status=status)
                if kind == "reset":  # after S3 acted on it: the client never learns the outcome
                    _abort(writer)
                    return
                if kind == "truncate" and body:
                    writer.write(head + body[: len(body) // 2])
                    await writer.drain()
                    _abort(writer)
                    return
                self.counts.forwarded += 1
                writer.write(head + body)
                await writer.drain()
                if hdrs.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, OSError, ValueError, IndexError):
            _abort(writer)
        finally:
            self._conns.discard(writer)
            if up is not None:
                up[1].transport.abort()
            if not writer.transport.is_closing():
                writer.close()

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
        head = await _read_head(reader)
        if head is None:
            return None
        hdrs = _headers(head)
        if hdrs.get("expect", "").lower() == "100-continue":
            # Answered here, and the header dropped upstream: the proxy decides before S3 sees the body.
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"expect:")]
            head = b"\r\n".join(lines)
        body = await _read_body(reader, hdrs)
        return _Request(head=head, body=body, method=head.split(b" ", 1)[0].decode("latin-1"))
