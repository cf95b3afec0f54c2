"""Peer-read messages: what daemons say to each other to read blocks out of one another's G2 over NIXL.

Two channels, both the fleet's existing authenticated ones:

* the events stream (topic :data:`HELLO_TOPIC`, next to the block events): every daemon serving peer reads
  announces a :class:`Hello` (its node, its peer-read endpoint, a random instance id) once a second, so a
  follower knows whom to ask and notices a restart (a new instance: its pins and NIXL agent are gone);
* the peer-read socket (ROUTER on the server, DEALER on the asker, CURVE as the request socket): requests framed
  ``[request id (8 bytes), message]``, answered ``[request id, reply]``.

A conversation: :class:`Connect` (the asker's NIXL agent metadata and credential; answered with the server's
metadata and its G2 pool's address), then per read a :class:`Pin` (the server brings the blocks to G2, pins them
under a lease with a deadline, answers each block's slot, size and xxh3-64 checksum), a one-sided NIXL READ by
the asker, and :class:`Unpin`. Every message carries ``v``: a peer speaking another version is refused, never
misread.
"""

from __future__ import annotations

from typing import Union

import msgspec

P2P_VERSION = 1
HELLO_TOPIC = b"kvbm-p2p"  # SUB prefix matching: followers subscribed to b"kvbm" receive it too
MAX_P2P_MESSAGE = 16 * 1024 * 1024  # NIXL agent metadata is a few KiB; a Pin of 4096 hashes well under this

E_VERSION = "version"
E_FORBIDDEN = "forbidden"
E_BUSY = "busy"
E_BAD = "bad_request"
E_UNKNOWN = "unknown_lease"
E_NOT_CONNECTED = "not_connected"


class Hello(msgspec.Struct, kw_only=True, gc=False):
    node_id: str
    endpoint: str  # the peer-read socket to dial
    instance: str  # random per process: a new one means the old pins and NIXL agent are gone
    v: int = P2P_VERSION


class _P2P(msgspec.Struct, tag_field="type", tag=True, kw_only=True, gc=False):
    v: int = P2P_VERSION


class Connect(_P2P, kw_only=True):
    node_id: str = ""
    agent: bytes  # the asker's NIXL agent metadata
    token: str = ""  # the asker's credential on a server with tenants (fleet.peer_read_token_file)


class Connected(_P2P, kw_only=True):
    agent_name: str
    agent: bytes  # the server's NIXL agent metadata (its G2 pool registered)
    pool_addr: int  # where the server's G2 pool starts in its address space (READ descriptors are absolute)
    slot_bytes: int
    num_slots: int
    instance: str


class Pin(_P2P, kw_only=True):
    namespace: str
    hashes: list[bytes]


class Pinned(_P2P, kw_only=True):
    lease: int
    slots: list[int]  # of the leading run the server holds, in order; shorter than the request when it ends
    nbytes: list[int]
    checksums: list[int]  # xxh3-64 of each block's payload as the server holds it
    lease_ms: float  # the pin is dropped after this long without an Unpin


class Unpin(_P2P, kw_only=True):
    lease: int


class Unpinned(_P2P, kw_only=True):
    count: int


class Refused(_P2P, kw_only=True):
    code: str
    message: str


Request = Union[Connect, Pin, Unpin]  # noqa: UP007
Reply = Union[Connected, Pinned, Unpinned, Refused]  # noqa: UP007

_req = msgspec.msgpack.Decoder(Request)
_rep = msgspec.msgpack.Decoder(Reply)
_hello = msgspec.msgpack.Decoder(Hello)
_enc = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode_request(buf: bytes) -> Request:
    return _req.decode(buf)


def decode_reply(buf: bytes) -> Reply:
    return _rep.decode(buf)


def decode_hello(buf: bytes) -> Hello:
    return _hello.decode(buf)
