"""The blocking client's connection to the daemon (:class:`kvbm.client.blocking.WorkerClient`): one ZeroMQ DEALER
socket, several requests in flight on it with their replies matched by request id, and, fail-fast, the socket's
monitor events and ZMTP heartbeats, so a daemon that is gone is seen at once instead of after ``timeout_s``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbm import protocol as p
from kvbm.client.errors import DaemonUnavailable

# Monitor events that end a fail-fast client's wait: the peer is gone, or it cannot be reached or admitted.
_LOST = zmq.EVENT_DISCONNECTED
_REFUSED = (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
# ZMTP ping interval of a fail-fast client. A daemon killed on this host closes its sockets, which is seen at once:
# heartbeats are for a host or network that vanished. A peer silent for SILENT_S is gone: long enough that a loaded
# host's stalls are not taken for that (a busy 2-core host starved a process 1.1 s; at 1 s a link dropped the
# saves in flight on it), short enough that nothing waits for the request timeout. Nothing on an engine's hot path
# waits on the link meanwhile (lookups give up on their own; saves run off the engine's thread).
HEARTBEAT_MS = 1000
SILENT_S = 5.0


class Wire:
    """The socket (made on first use, replaced after a failure), the rids sent and not yet awaited (``sent``) and
    the replies that came for them while another was awaited."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any], setup: Callable[[zmq.Socket[Any]], None],
                 fail_fast: bool) -> None:
        self.endpoint, self._ctx, self._setup, self.fail_fast = endpoint, ctx, setup, fail_fast
        self._sock: zmq.Socket[Any] | None = None
        self._mon: zmq.Socket[Any] | None = None  # the socket's monitor events (fail_fast only)
        self._up = False  # the connection's handshake succeeded and it has not dropped since
        self.sent: set[int] = set()  # rids sent and not yet awaited
        self._early: dict[int, Any] = {}  # their replies that arrived while another request's reply was awaited

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            if self.fail_fast:
                sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(SILENT_S * 1000))
                self._mon = sock.get_monitor_socket(_LOST | _REFUSED | _UP)
            self._setup(sock)
            self._sock, self._up = sock, False
        return self._sock

    def reset(self) -> None:
        """Close the socket (replies still due are lost with it: a late one cannot be taken for the next)."""
        self.sent.clear()
        self._early.clear()
        if self._sock is not None:
            if self._mon is not None:
                self._sock.disable_monitor()
                self._mon.close(0)
                self._mon = None
            self._sock.close(0)
            self._sock = None

    def _watch(self) -> None:
        """Read the monitor's events; raise DaemonUnavailable when the connection dropped or cannot be made."""
        mon = self._mon
        while mon is not None and mon.poll(0):
            event = parse_monitor_message(mon.recv_multipart())["event"]
            if event & _UP:
                self._up = True
            elif event & _LOST or not self._up:
                # Dropped (requests in flight are lost with it), or refused before it was ever up.
                what = "lost" if event & _LOST else "refused"
                self.reset()
                raise DaemonUnavailable(f"connection to {self.endpoint} {what}")

    def lost(self) -> bool:
        """(Fail-fast.) Whether the connection dropped, or could not be made, as far as the monitor said until now
        (read without waiting); a lost socket is closed, as a request would find it."""
        try:
            self._watch()
        except DaemonUnavailable:
            return True
        return False

    def send(self, rid: int, buf: bytes) -> None:
        """Send request ``rid`` without waiting: several requests may be in flight, see :meth:`wait`."""
        sock = self._socket()
        if self._mon is not None and not self.sent:
            try:
                self._watch()  # a connection that dropped while idle is replaced now, not at the next wait
            except DaemonUnavailable:
                sock = self._socket()
        self.sent.add(rid)
        try:
            sock.send(buf, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.reset()
            raise DaemonUnavailable(f"cannot send to {self.endpoint}") from None

    def wait(self, rid: int, timeout_s: float, max_message_bytes: int, said_s: float) -> Any:
        """The reply to request ``rid`` within ``timeout_s`` (``said_s``: the timeout an error names); replies to
        other requests in flight are kept."""
        self.sent.discard(rid)
        early = self._early.pop(rid, None)
        if early is not None:
            return early
        sock = self._socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._mon is not None:
            poller.register(self._mon, zmq.POLLIN)
        now = time.monotonic()
        deadline = now + timeout_s
        # A fail-fast connection not up within SILENT_S is not going to be (a host that drops the SYN, a stopped
        # process whose kernel accepted it): heartbeats only watch a connection once it is up.
        handshake_by = now + SILENT_S if self._mon is not None else deadline
        while True:
            now = time.monotonic()
            if self._mon is not None and not self._up and now > handshake_by:
                self.reset()
                raise DaemonUnavailable(f"no handshake with {self.endpoint}")
            left = (deadline if self._up else min(deadline, handshake_by)) - now
            ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}
            if not ready and time.monotonic() >= deadline:
                self.reset()
                raise DaemonUnavailable(f"no reply from {self.endpoint} within {said_s:g}s")
            if not ready:
                continue
            if sock not in ready:
                self._watch()
                continue
            self._up = True  # a reply came: whatever the monitor has not said yet, the connection is up
            frames = sock.recv_multipart()
            try:
                reply = p.decode_reply(frames[-1], max_message_bytes)
            except p.ProtocolError:
                continue
            if reply.rid == rid:
                return reply
            if reply.rid in self.sent:  # another request in flight: its reply is kept for its wait
                self._early[reply.rid] = reply
