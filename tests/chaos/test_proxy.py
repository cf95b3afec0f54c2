"""The S3 fault proxy against a real SeaweedFS: it forwards untouched when told nothing, and each fault it is told
to inject is what an S3 client sees."""

from __future__ import annotations

import http.client
import time

import pytest

from kvbm.chaos.proxy import FaultProxy, FaultRates

# An exception in the proxy thread (its stop) is an error here, not a warning.
pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]


def _get(port: int, path: str = "/kvbm-test/none") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.fixture
def proxy(s3_server):
    host, port = s3_server.endpoint.split("//")[1].rsplit(":", 1)
    px = FaultProxy((host, int(port)), seed=7).start()
    yield px
    px.stop()


def test_the_proxy_forwards_what_it_is_not_told_to_break(proxy, s3_server) -> None:
    direct = http.client.HTTPConnection(*s3_server.endpoint.split("//")[1].rsplit(":", 1), timeout=5)
    direct.request("GET", "/kvbm-test/none")
    want = direct.getresponse()
    want_body = want.read()
    direct.close()
    status, body = _get(proxy.port)
    assert (status, body.split(b"<RequestId>")[0]) == (want.status, want_body.split(b"<RequestId>")[0])
    assert proxy.counts.forwarded == 1 and proxy.counts.injected == {}


@pytest.mark.parametrize("kind", ["error500", "slowdown503", "reset", "truncate", "latency"])
def test_each_injected_fault_is_what_the_client_sees(proxy, kind: str) -> None:
    proxy.rates = FaultRates(**{kind: 1.0}, latency_s=(0.3, 0.3))
    t0 = time.monotonic()
    if kind == "error500":
        status, body = _get(proxy.port)
        assert status == 500 and b"<Code>InternalError</Code>" in body
    elif kind == "slowdown503":
        status, body = _get(proxy.port)
        assert status == 503 and b"<Code>SlowDown</Code>" in body
    elif kind == "reset":
        with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
            _get(proxy.port)
    elif kind == "truncate":
        with pytest.raises((http.client.IncompleteRead, ConnectionResetError)):
            _get(proxy.port)
    else:
        status, _ = _get(proxy.port)
        assert status != 500 and time.monotonic() - t0 >= 0.3
    assert proxy.counts.injected == {kind: 1}


def test_an_outage_refuses_every_request_until_it_ends(proxy) -> None:
    proxy.outage(1.0)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected, ConnectionRefusedError)):
        _get(proxy.port)
    time.sleep(1.1)
    assert _get(proxy.port)[0] < 500
    assert proxy.counts.injected == {"outage": 1}


def test_stopping_with_a_request_held_back_leaves_nothing_running(s3_server, caplog) -> None:
    """stop() while a request sleeps out its injected latency: the proxy's loop used to close with that task still
    pending, and its destruction later raised 'Event loop is closed' (an unraisable error; sometimes a pytest
    INTERNALERROR). Every task ends before the loop closes."""
    import contextlib
    import gc
    import sys
    import threading

    gc.collect()  # earlier tests' garbage (their own loops' tasks) is not this proxy's
    caplog.clear()
    host, port = s3_server.endpoint.split("//")[1].rsplit(":", 1)
    px = FaultProxy((host, int(port)), seed=7).start()
    px.rates = FaultRates(latency=1.0, latency_s=(3.0, 3.0))
    def request() -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):  # the connection is cut at stop
            _get(px.port)

    client = threading.Thread(target=request, daemon=True)
    client.start()
    time.sleep(0.5)  # the request is in, sleeping out its latency
    unraisable: list[str] = []
    old, sys.unraisablehook = sys.unraisablehook, lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        px.stop()
        client.join(10)
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert not unraisable, unraisable
    destroyed = [r.getMessage() for r in caplog.records
                 if "destroyed but it is pending" in r.getMessage() and "FaultProxy" in r.getMessage()]
    assert not destroyed, destroyed
