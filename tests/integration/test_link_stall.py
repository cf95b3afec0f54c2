"""A fail-fast link (the vLLM connector's) tells a daemon that is gone from a host that stalled: a loaded 2-core
host starves a process for over a second (measured: 1.1 s under a CPU engine and two busy loops), and a link that
called that a lost daemon dropped the saves in flight on it (a next turn missing blocks it had stored)."""

from __future__ import annotations

import signal
import time

import pytest
from serve_proc import ServeProc

from kvbm import protocol as p
from kvbm.client import WorkerClient
from kvbm.client.errors import DaemonUnavailable
from kvbm.client.wire import SILENT_S

STALL_S = 2.5  # longer than any stall measured on a loaded CI host, well inside SILENT_S


@pytest.fixture
def daemon(tmp_path):
    from test_vllm_e2e import free_port
    from test_vllm_outage import daemon_cfg

    d = ServeProc(tmp_path, daemon_cfg(tmp_path, free_port())).start()
    yield d
    d.stop()


def _stall(daemon: ServeProc, seconds: float) -> None:
    daemon.proc.send_signal(signal.SIGSTOP)  # alive, silent: its ZeroMQ I/O thread answers no heartbeat
    try:
        time.sleep(seconds)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)


def test_a_request_in_flight_across_a_stall_of_a_few_seconds_gets_its_reply(daemon):
    assert STALL_S < SILENT_S
    with WorkerClient(daemon.endpoint, timeout_s=30.0, fail_fast=True) as c:
        c.ping()  # the connection is up
        msg = c.begin(p.Ping())
        _stall(daemon, STALL_S)
        c.finish(msg, p.Pong)  # before: DaemonUnavailable("connection ... lost") after 1 s of silence


def test_a_daemon_silent_past_the_limit_is_gone_before_the_request_timeout(daemon):
    with WorkerClient(daemon.endpoint, timeout_s=60.0, fail_fast=True) as c:
        c.ping()
        daemon.proc.send_signal(signal.SIGSTOP)  # before the request: a quick daemon would answer it first
        try:
            msg = c.begin(p.Ping())
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="lost"):
                c.finish(msg, p.Pong)
            assert time.monotonic() - t0 < 60.0 / 2  # the heartbeats said so, not the request's timeout
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        c.ping()  # and the link comes back once the daemon does
