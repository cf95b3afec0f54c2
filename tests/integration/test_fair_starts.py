"""One tenant's backlog does not sit in front of another tenant's request (issue 37, kvbm.daemon.fairness).

A ``kvbm serve`` subprocess with two tenants; both register with real clients. Tenant b's backlog and then one
request of tenant a go down one connection, so the daemon reads them in that order (one ZeroMQ pipe is FIFO) and
answers on that connection in the order it replies: the property is counted in replies, never timed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import zmq
from serve_proc import ServeProc

from kvbm import protocol as p
from kvbm.blocks.layout import KVLayout
from kvbm.client import WorkerClient

SLOT = 64 * 1024
LAYOUT_A = KVLayout(model="team-a/llama", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                    block_bytes=SLOT)
LAYOUT_B = KVLayout(model="team-b/qwen", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16",
                    block_bytes=SLOT)
BACKLOG = 30  # b's requests queued ahead of a's (b's max_inflight, 256 by default, admits them all)
# ZeroMQ reads a connection this much at a time (ZMQ_IN_BATCH_SIZE) and hands the daemon what one read decoded at
# once: the backlog and a's request fit in one read, so the daemon's receive loop reads them all in one pass.
# Past it, a's request came in a later read, after the loop had started and answered b's first ones (37 of 60).
ZMQ_READ = 8192
SETTLE_S = 1.0
ROUNDS = 3


def cfg(tmp: Path) -> dict:
    return {
        "block_bytes": SLOT, "device": {"enabled": False}, "host": {"capacity": "4MiB"},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"metrics_port": 0, "endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", "tenants": [
            {"name": "a", "token_file": str(tmp / "a.token"), "models": ["team-a/*"]},
            {"name": "b", "token_file": str(tmp / "b.token"), "models": ["team-b/*"]},
        ]},
    }


def zmtp_bytes(msgs: list[bytes]) -> int:
    """What ``msgs`` take on the wire, one frame each (ZMTP 3: flags and a 1-byte size, or an 8-byte one)."""
    return sum(len(m) + (2 if len(m) <= 255 else 9) for m in msgs)


def lookup(token: str, ns: str, rid: int) -> bytes:
    return p.encode(p.Lookup(token=token, rid=rid, namespace=ns, hashes=[rid.to_bytes(4, "big") * 8]))


def _round(d: ServeProc, sock: zmq.Socket, a: WorkerClient, b: WorkerClient, first: int) -> int:
    """b's backlog then a's request, sent while the daemon is stopped; how many of b's were answered before a's."""
    msgs = [lookup(b.token, b.namespace, first + i) for i in range(1, BACKLOG + 1)]
    msgs.append(lookup(a.token, a.namespace, first))
    assert zmtp_bytes(msgs) <= ZMQ_READ
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        for m in msgs:
            sock.send(m)
        time.sleep(SETTLE_S)  # lets this side hand them to the socket (they are queued in order either way)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    order: list[int] = []
    while len(order) < BACKLOG + 1:
        assert sock.poll(30_000), f"the daemon stopped answering after {len(order)} replies"
        rep = p.decode_reply(sock.recv())
        assert isinstance(rep, p.LookupReply), rep
        order.append(rep.rid - first)
    assert sorted(order) == list(range(BACKLOG + 1))  # all answered, none twice
    return order.index(0)


def test_a_tenants_request_is_answered_before_another_tenants_backlog(tmp_path: Path) -> None:
    """With the daemon stopped (SIGSTOP), b's 30 Lookups and then a's one are queued on one connection; on SIGCONT
    the daemon reads them in that order. Before, every request read was started at once and asyncio ran them
    first come first served: a's Lookup was answered after all of b's. Now b starts ``daemon.fair_burst`` (4)
    per loop turn and a's starts the turn it is read: a is answered before most of b's backlog, and every one of
    b's requests is still answered (none refused, none lost).

    The premise is that the daemon reads them together. On a loaded host a's bytes may reach the daemon's socket
    only after it ran again and answered b's first ones (seen: after 32 and 37 of 60): the round is played again,
    up to ROUNDS times. Without fair starts every round answers a's last (after all 30), so this cannot pass."""
    d = ServeProc(tmp_path, cfg(tmp_path)).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        token = {t: (tmp_path / f"{t}.token").read_text().strip() for t in "ab"}
        with d.client(tenant_token=token["a"]) as a, d.client(tenant_token=token["b"]) as b:
            a.register(LAYOUT_A, worker_id="a0")
            b.register(LAYOUT_B, worker_id="b0")
            sock.connect(d.endpoint)
            sock.send(p.encode(p.Ping(rid=10_000)))  # the connection is up (handshaken) before the daemon stops
            assert sock.poll(30_000) and isinstance(p.decode_reply(sock.recv()), p.Pong)
            aheads = []
            for r in range(ROUNDS):
                aheads.append(_round(d, sock, a, b, 1000 * (r + 1)))
                if aheads[-1] < BACKLOG // 2:
                    break
            with d.client(admin=True) as adm:
                deferred = adm.stats()["daemon"].get("deferred", 0)
        assert aheads[-1] < BACKLOG // 2, f"a's request was answered after {aheads} of b's {BACKLOG} queued requests"
        assert deferred > 0
    finally:
        sock.close(0)
        d.stop()
