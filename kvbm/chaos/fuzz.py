"""Hostile input at the daemon's sockets: malformed and out-of-range frames, floods beyond caps, Register storms.

Frames are made from a seeded ``random.Random`` (:func:`hostile_frames`); :func:`send_frames` sends them on a
raw DEALER, gathers the replies and says which were not a named refusal (every Error reply must carry a known
code and a message). :func:`poke_stream` writes garbage below ZeroMQ, straight into the socket's stream (an
``ipc://`` path or a ``tcp://`` port), and :func:`poke_events` floods the events socket with subscriptions and
wrong-type peers. None of it may stop the daemon: the harness checks it still answers afterwards.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvbm import protocol as p
from kvbm.blocks.layout import KVLayout

KNOWN_CODES = frozenset({
    p.E_MALFORMED, p.E_VERSION, p.E_UNKNOWN_TYPE, p.E_TOO_LARGE, p.E_UNREGISTERED, p.E_BAD_REQUEST, p.E_INTERNAL,
    p.E_TIMEOUT, p.E_FULL, p.E_STALE, p.E_LIMIT, p.E_BUSY, p.E_UNAVAILABLE, p.E_FORBIDDEN,
})

_raw = msgspec.msgpack.Encoder()


@dataclass
class Frames:
    kind: str
    frames: list[bytes]
    answered: bool = True  # whether the daemon owes a reply (a frame set it cannot route is dropped)


@dataclass
class FuzzResult:
    sent: dict[str, int] = field(default_factory=dict)
    replies: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # Error replies by code
    unnamed: list[str] = field(default_factory=list)  # replies that were not a named refusal nor a valid reply
    tokens: list[str] = field(default_factory=list)  # sessions Registered by the frames (to unregister them)

    def merge(self, other: FuzzResult) -> None:
        for k, v in other.sent.items():
            self.sent[k] = self.sent.get(k, 0) + v
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v
        self.replies += other.replies
        self.unnamed += other.unnamed


def layout_dict(layout: KVLayout) -> dict[str, Any]:
    return msgspec.to_builtins(layout)  # type: ignore[no-any-return]


def _msg(kind: str, rid: int, **fields: Any) -> bytes:
    """A message as a plain map, so fields may break the schema."""
    return _raw.encode({"type": kind, "v": p.PROTOCOL_VERSION, "rid": rid, **fields})


def hostile_frames(rng: random.Random, n: int, *, token: str, generation: str, namespace: str,
                   layout: KVLayout, tenant_token: str = "", max_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
                   oversized: bool = True) -> list[Frames]:
    """``n`` hostile frame sets drawn by ``rng`` (the same draw for the same rng state)."""
    good = p.encode(p.Lookup(rid=1, token=token, namespace=namespace, hashes=[b"h" * 16]))
    lay = layout_dict(layout)
    h = [rng.randbytes(16) for _ in range(4)]

    def out_of_range(rid: int) -> bytes:
        choice = rng.randrange(17)
        base = {"token": token, "namespace": namespace}
        if choice == 0:
            return _msg("Lookup", rid, **base, hashes=[b"x" * (p.MAX_HASH_BYTES + 1)])
        if choice == 1:
            return _msg("Lookup", rid, **base, hashes=[b""])
        if choice == 2:
            return _msg("Lookup", rid, **base, hashes=[b"h"] * (p.MAX_BATCH + 1))
        if choice == 3:
            return _msg("Lookup", rid, token=token, namespace="n" * (p.MAX_STR + 1), hashes=h)
        if choice == 4:
            return _msg("PrepareStore", rid, **base, hashes=h, nbytes=rng.choice([-1, 0, 2**62, 2**64 - 1]),
                        generation=generation)
        if choice == 5:
            return _msg("Register", rid, worker_id="w", engine_id="e", layout=lay, tp_rank=rng.choice([-1, 5000, 3]),
                        tp_size=rng.choice([0, 1, 2]), tenant_token=tenant_token)
        if choice == 6:
            bad = dict(lay, num_layers=rng.choice([0, -3, 2**40]), head_size=rng.choice([0, -1, 2**31]))
            return _msg("Register", rid, worker_id="w", engine_id="e", layout=bad, tenant_token=tenant_token)
        if choice == 7:
            return _msg("Barrier", rid, token=token, engine_id="e", step=rng.choice([{"a": 1}, [1], 1.5, None]),
                        rank=0, timeout_s=rng.choice([-1.0, 1e9, float("nan")]))
        if choice == 8:
            return _msg("Onboard", rid, **base, hashes=[rng.randbytes(32) for _ in range(rng.choice([1, 4096]))],
                        generation=generation)
        if choice == 9:
            return _msg("CommitStore", rid, **base, hashes=h, ok=rng.choice([True, False]), durable=True,
                        generation="not-the-pool")
        if choice == 10:
            return _msg("Evict", rid, **base, hashes=None, tiers=["G9"] * rng.choice([1, 17]))
        if choice == 11:
            return _msg("Stats", rid, token=token, resident=True)
        if choice == 12:
            return _msg("Reindex", rid, token=token, namespace=namespace, tiers=["G4"])
        if choice == 13:
            return _raw.encode({"type": "Lookup", "v": p.PROTOCOL_VERSION, "rid": rng.choice(["x", -1, 2**64 - 1]),
                                **base, "hashes": h})
        if choice == 14:
            return _msg(rng.choice(["Nope", "Registered", "Error", ""]), rid, **base)
        if choice == 15:
            return _raw.encode({"type": "Ping", "v": rng.choice([0, 1, 3, "2", None]), "rid": rid})
        layout_str = dict(lay, model="m" * 5000, dtype=rng.choice(["float16", "int3", ""]))
        return _msg("Register", rid, worker_id="w" * rng.choice([1, 300]), engine_id="e", layout=layout_str,
                    tenant_token=tenant_token)

    out: list[Frames] = []
    for i in range(n):
        rid = 1000 + i
        kind = rng.choices(["random", "truncated", "out_of_range", "frames", "oversized"], [3, 3, 6, 1, 1])[0]
        if kind == "random":
            out.append(Frames(kind, [rng.randbytes(rng.randint(0, 400))]))
        elif kind == "truncated":
            full = _msg("PrepareStore", rid, token=token, namespace=namespace, hashes=h, nbytes=4096,
                        generation=generation) if rng.random() < 0.5 else good
            out.append(Frames(kind, [full[: rng.randrange(len(full))]]))
        elif kind == "out_of_range":
            out.append(Frames(kind, [out_of_range(rid)]))
        elif kind == "frames":
            shape = rng.randrange(3)
            if shape == 0:
                out.append(Frames(kind, [b"", good]))  # a REQ's delimiter: answered
            elif shape == 1:
                out.append(Frames(kind, [good, good, good], answered=False))
            else:
                out.append(Frames(kind, [b"x", b"", good], answered=False))
        elif oversized:
            size = max_bytes + rng.randint(1, 4096)
            out.append(Frames(kind, [_msg("Lookup", rid, token=token, namespace=namespace, hashes=h,
                                          pad=b"\0" * size)]))
        else:
            out.append(Frames("random", [rng.randbytes(64)]))
    return out


def check_reply(buf: bytes) -> str:
    """"" when ``buf`` is a valid reply and any Error in it names its cause; else what is wrong."""
    try:
        rep = p.decode_reply(buf)
    except p.ProtocolError as e:
        return f"undecodable reply: {e}"
    if isinstance(rep, p.Error):
        if rep.code not in KNOWN_CODES:
            return f"Error with unknown code {rep.code!r}: {rep.message[:120]!r}"
        if not rep.message.strip():
            return f"Error {rep.code!r} with no message"
    return ""


def send_frames(endpoint: str, batch: list[Frames], *, wait_s: float = 3.0,
                ctx: zmq.Context[Any] | None = None) -> FuzzResult:
    """Send every frame set on one DEALER, then read replies until all owed ones came or ``wait_s`` passed."""
    ctx = ctx or zmq.Context.instance()
    res = FuzzResult()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    try:
        sock.connect(endpoint)
        owed = 0
        for f in batch:
            res.sent[f.kind] = res.sent.get(f.kind, 0) + 1
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(f.frames, flags=zmq.NOBLOCK if len(f.frames[-1]) < 1 << 20 else 0)
                owed += f.answered
        deadline = time.monotonic() + wait_s
        while res.replies < owed and time.monotonic() < deadline:
            if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            frames = sock.recv_multipart()
            res.replies += 1
            rep = frames[-1]
            if why := check_reply(rep):
                res.unnamed.append(why)
                continue
            msg = p.decode_reply(rep)
            if isinstance(msg, p.Error):
                res.errors[msg.code] = res.errors.get(msg.code, 0) + 1
            elif isinstance(msg, p.Registered):
                res.tokens.append(msg.token)
    finally:
        sock.close(0)
    return res


def poke_stream(endpoint: str, rng: random.Random, tries: int = 4) -> int:
    """Garbage bytes straight into the endpoint's stream socket (below ZeroMQ's framing); connections made."""
    made = 0
    for _ in range(tries):
        try:
            if endpoint.startswith("ipc://"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(1.0)
                s.connect(endpoint[len("ipc://"):])
            elif endpoint.startswith("tcp://"):
                host, port = endpoint[len("tcp://"):].rsplit(":", 1)
                s = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
            else:
                return made
        except OSError:
            continue
        made += 1
        with s, contextlib.suppress(OSError):
            greeting = b"\xff" + b"\0" * 8 + b"\x7f" if rng.random() < 0.5 else b""  # half a ZMTP greeting
            s.sendall(greeting + rng.randbytes(rng.randint(1, 2048)))
    return made


def poke_events(endpoint: str, rng: random.Random, subscriptions: int = 500,
                ctx: zmq.Context[Any] | None = None) -> int:
    """Subscribe and unsubscribe ``subscriptions`` random topics, and connect peers of the wrong socket type."""
    ctx = ctx or zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    wrong = ctx.socket(rng.choice([zmq.PUB, zmq.DEALER, zmq.PUSH]))
    wrong.setsockopt(zmq.LINGER, 0)
    try:
        sub.connect(endpoint)
        wrong.connect(endpoint)
        topics = [rng.randbytes(rng.randint(0, 64)) for _ in range(subscriptions)]
        for t in topics:
            sub.setsockopt(zmq.SUBSCRIBE, t)
        for t in topics[: subscriptions // 2]:
            sub.setsockopt(zmq.UNSUBSCRIBE, t)
        with contextlib.suppress(zmq.ZMQError):
            wrong.send_multipart([p.EVENTS_TOPIC, b"\0" * 8, rng.randbytes(100)], flags=zmq.NOBLOCK)
        time.sleep(0.05)
    finally:
        sub.close(0)
        wrong.close(0)
    return subscriptions
