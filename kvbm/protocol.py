"""Wire protocol between workers and the kvbm daemon (msgpack over ZeroMQ).

Every message is a tagged ``msgspec.Struct`` (``"type"`` names it) carrying the protocol version
``v`` and a request id ``rid`` that the reply echoes. Requests (except :class:`Register`) carry the
worker ``token`` handed out by :class:`Registered`; requests that name G2 slots (PrepareStore,
CommitStore, Onboard, Release) also carry the pool ``generation`` from :class:`Registered` and are
refused (``E_STALE``) when it is not the daemon's current pool: a worker that outlived a daemon restart
must map the new pool before touching a slot. Blocks are named by one ``namespace`` (the layout's)
plus a list of chained block hashes. A request is one frame; a DEALER sends ``[payload]`` and the
daemon's ROUTER answers ``[payload]`` (a REQ's empty delimiter frame is accepted and echoed).

Every field is bounded (:data:`MAX_BATCH` hashes of 1..:data:`MAX_HASH_BYTES` bytes, strings of
:data:`MAX_STR` characters, ranks and sizes non-negative); a message outside the bounds is refused
``E_LIMIT`` naming the field. Authorization (the daemon's, see kvbm.daemon): a worker's token is bound
to its layout's namespace, other namespaces are ``E_FORBIDDEN``; Evict, Reindex and resident hashes need
an admin session (:class:`Register` with ``admin_token``).

The daemon also publishes its own block events on a PUB socket as ``[b"kvbm", seq(8 bytes, big
endian), msgpack(EventBatch)]``: the same framing vLLM uses for its KV-event stream.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.errors import KvbmError

PROTOCOL_VERSION = 2  # 2: G2 pool generation in Registered and in slot requests
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
EVENTS_TOPIC = b"kvbm"

# Bounds on every field of a request (a hostile but well-formed message is refused E_LIMIT).
MAX_BATCH = 65536  # hashes per request
MAX_HASH_BYTES = 32  # kvbm.blocks.MAX_HASH_LEN: a block header holds at most this much
MAX_STR = 256  # namespaces, ids, tokens, tier names, barrier steps
MAX_TIERS = 16
MAX_RANKS = 4096

Str = Annotated[str, Meta(max_length=MAX_STR)]
Hash = Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
Hashes = Annotated[list[Hash], Meta(max_length=MAX_BATCH)]
Tiers = Annotated[list[Str], Meta(max_length=MAX_TIERS)]
Rank = Annotated[int, Meta(ge=0, le=MAX_RANKS)]


class ProtocolError(KvbmError):
    """A frame that is not a valid message of this protocol version; ``code`` says why."""

    def __init__(self, code: str, message: str, rid: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.rid = rid


class _Msg(msgspec.Struct, tag_field="type", tag=True, kw_only=True, gc=False):
    v: int = PROTOCOL_VERSION
    rid: int = 0


class _Req(_Msg, kw_only=True):
    token: Str = ""


class _Blocks(_Req, kw_only=True):
    namespace: Str
    hashes: Hashes

    def keys(self) -> list[BlockKey]:
        return [BlockKey(self.namespace, h) for h in self.hashes]


class _SlotReq(_Blocks, kw_only=True):
    """A request about G2 slots: valid only for the pool generation the worker mapped."""

    generation: Str = ""


# -- requests ----------------------------------------------------------------------------------------
class Register(_Req, kw_only=True):
    """Announce a worker (one TP rank of one engine) and its KV layout."""

    worker_id: Str
    engine_id: Str
    layout: KVLayout
    tp_rank: Rank = 0
    tp_size: Rank = 1
    g1_capacity_blocks: Annotated[int, Meta(ge=0)] = 0
    admin_token: Str = ""  # the daemon's admin token: this session may evict, reindex, use any namespace
    tenant_token: Str = ""  # a tenant's token (daemon.tenants): the models/namespaces it may register, its limits


class Unregister(_Req, kw_only=True):
    """The worker is leaving: its pins and unfinished stores are released."""


class Ping(_Req, kw_only=True):
    """Keep the worker's lease alive."""


class Lookup(_Blocks, kw_only=True):
    """How many leading blocks are held anywhere, and the fastest tier of each."""


class PrepareStore(_SlotReq, kw_only=True):
    """Reserve a G2 slot per block (the worker then copies the bytes into shared memory)."""

    nbytes: Annotated[int, Meta(ge=0)]


class CommitStore(_SlotReq, kw_only=True):
    """Commit (``ok``) or abort prepared slots; ``durable`` waits until they are on disk/S3.

    ``partial``: the blocks are partial blocks (a request's tail past its last full block): evicted before other
    blocks until a load hits them. ``covers`` (empty, or one list per hash): the partial blocks each block
    supersedes (those whose tokens it begins with), dropped from every tier once it is held. Both are defaulted,
    so no new protocol version: a daemon before them ignores them (stores the blocks as ordinary ones), a worker
    before them sends neither."""

    ok: bool = True
    durable: bool = False
    partial: bool = False
    covers: Annotated[list[Hashes], Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)


class Onboard(_SlotReq, kw_only=True):
    """Bring the leading held run into G2 and pin it there for this worker until :class:`Release`."""


class Release(_SlotReq, kw_only=True):
    """Drop this worker's pins on blocks it onboarded."""


class Stats(_Req, kw_only=True):
    """The manager's and the daemon's counters; with ``resident`` also every followed vLLM engine's
    GPU-resident block hashes (as vLLM publishes them: ints, or bytes)."""

    resident: bool = False


class Barrier(_Req, kw_only=True):
    """Wait until all ``world_size`` TP ranks of ``engine_id`` reached ``step`` (or time out)."""

    engine_id: Str
    step: int | Str
    rank: Rank
    world_size: Rank = 0  # 0: the registered tp_size
    timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 0.0  # 0: the daemon's default


class Evict(_Req, kw_only=True):
    """Remove blocks (``hashes``, or every block of ``namespace`` when None) from ``tiers`` (all if None).

    Blocks pinned by a worker are skipped.
    """

    namespace: Str
    hashes: Hashes | None = None
    tiers: Tiers | None = None
    gone: bool = False  # already deleted from disk/S3 by the sender (kvbm purge): drop the index entries, no I/O


class Reindex(_Req, kw_only=True):
    """Re-read what ``tiers`` (all persistent ones if None) hold for ``namespace`` (all if empty), e.g.
    after ``kvbm prewarm`` wrote block files into the disk directory behind the daemon's back."""

    namespace: Str = ""
    tiers: Tiers | None = None


# -- replies -----------------------------------------------------------------------------------------
class Registered(_Msg, kw_only=True):
    token: str
    namespace: str
    shm_name: str
    generation: str  # random per G2 pool creation: a new value means "map the pool again"
    slot_bytes: int
    num_slots: int
    capacity_bytes: int
    block_nbytes: int
    # G2 slots this session may hold at once (pinned by Onboard + prepared by PrepareStore); a slot request
    # beyond it is answered E_FULL. 0: not stated (a daemon before this field; decoders ignore fields they do
    # not know and default those missing, so a defaulted reply field needs no new protocol version).
    session_slots: int = 0


class Pong(_Msg, kw_only=True):
    pass


class LookupReply(_Msg, kw_only=True):
    matched: int
    tiers: list[str]


class Slots(_Msg, kw_only=True):
    slots: list[int | None]  # None: already stored or being stored by someone else (nothing to copy)


class Shed(_Msg, kw_only=True):
    """The daemon is overloaded and dropped this offload; the worker may retry later."""

    retry_after_ms: int = 100


class Ack(_Msg, kw_only=True):
    stored: int
    durable: int = 0


class Onboarded(_Msg, kw_only=True):
    count: int
    slots: list[int]
    nbytes: list[int]
    # The leading run held in any tier: more than ``count`` when the pins stopped short for want of room (the
    # session's budget, unpinned slots in G2) or a bring-up failed, so asking again later may pin more. -1: unsaid.
    held: int = -1


class Released(_Msg, kw_only=True):
    count: int


class StatsReply(_Msg, kw_only=True):
    stats: dict[str, Any]


class BarrierReply(_Msg, kw_only=True):
    arrived: int
    complete: bool


class Evicted(_Msg, kw_only=True):
    removed: int
    skipped: int = 0


class Reindexed(_Msg, kw_only=True):
    blocks: int  # blocks the re-read tiers now hold (for the namespace)
    added: int  # of them, blocks those tiers' index did not have before


class Error(_Msg, kw_only=True):
    code: str
    message: str = ""


Request = Union[  # noqa: UP007 - msgspec wants a Union of tagged structs
    Register, Unregister, Ping, Lookup, PrepareStore, CommitStore, Onboard, Release, Stats, Barrier, Evict, Reindex
]
Reply = Union[  # noqa: UP007
    Registered, Pong, LookupReply, Slots, Shed, Ack, Onboarded, Released, StatsReply, BarrierReply, Evicted,
    Reindexed, Error,
]

# Error codes.
E_MALFORMED = "malformed"
E_VERSION = "version"
E_UNKNOWN_TYPE = "unknown_type"
E_TOO_LARGE = "too_large"
E_UNREGISTERED = "unregistered"
E_BAD_REQUEST = "bad_request"
E_INTERNAL = "internal"
E_TIMEOUT = "timeout"
E_FULL = "full"
E_STALE = "stale_generation"
E_LIMIT = "limit"  # a field outside its bounds (batch length, hash length, string length, rank)
E_BUSY = "busy"  # too many of this client's requests in flight (its session's or its tenant's cap): load, retry
E_UNAVAILABLE = "unavailable"  # a tier the request needs cannot be reached now (S3 outage); try again later
E_FORBIDDEN = "forbidden"  # another worker's namespace, or an admin request without the admin token


# -- daemon block events -----------------------------------------------------------------------------
class _Event(msgspec.Struct, tag_field="type", tag=True, kw_only=True, gc=False):
    namespace: str
    hashes: list[bytes]
    tier: str = "G2"
    nbytes: int = 0  # payload bytes of each block (BlocksStored; 0: not known), so peers index them without I/O


class BlocksStored(_Event, kw_only=True):
    pass


class BlocksRemoved(_Event, kw_only=True):
    pass


class BlocksOnboarded(_Event, kw_only=True):
    worker_id: str = ""


Event = Union[BlocksStored, BlocksRemoved, BlocksOnboarded]  # noqa: UP007


class EventBatch(msgspec.Struct, kw_only=True, gc=False):
    ts: float
    events: list[Event]
    v: int = PROTOCOL_VERSION


# -- codec -------------------------------------------------------------------------------------------
class _Header(msgspec.Struct, gc=False):
    """Just enough of any message to tell why it did not decode."""

    type: Any = None
    v: Any = None
    rid: Any = 0


_BOUND = re.compile(r"of length [<>]=|` [<>]= ")  # msgspec's words for a violated Meta bound
_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(Request)
_rep_decoder = msgspec.msgpack.Decoder(Reply)
_hdr_decoder = msgspec.msgpack.Decoder(_Header)
_event_decoder = msgspec.msgpack.Decoder(EventBatch)
_REQ_TAGS = {c.__name__ for c in Request.__args__}  # type: ignore[attr-defined]
_REP_TAGS = {c.__name__ for c in Reply.__args__}  # type: ignore[attr-defined]


def encode(msg: _Msg | EventBatch, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """One message as msgpack; raises ProtocolError when it exceeds ``max_bytes``."""
    buf = _encoder.encode(msg)
    if len(buf) > max_bytes:
        raise ProtocolError(E_TOO_LARGE, f"{type(msg).__name__} is {len(buf)} bytes > {max_bytes}")
    return buf


def _decode(buf: bytes | memoryview, decoder: msgspec.msgpack.Decoder, tags: set[str], max_bytes: int) -> Any:
    if len(buf) > max_bytes:
        raise ProtocolError(E_TOO_LARGE, f"{len(buf)} bytes > {max_bytes}")
    try:
        msg = decoder.decode(buf)
    except Exception as e:  # ValidationError, DecodeError, or a __post_init__ error (e.g. a bad layout)
        try:
            hdr = _hdr_decoder.decode(buf)
        except Exception:
            raise ProtocolError(E_MALFORMED, f"not a msgpack message: {e}") from None
        rid = hdr.rid if isinstance(hdr.rid, int) else 0
        if hdr.v != PROTOCOL_VERSION:
            raise ProtocolError(E_VERSION, f"protocol version {hdr.v!r}, expected {PROTOCOL_VERSION}", rid) from None
        if hdr.type not in tags:
            raise ProtocolError(E_UNKNOWN_TYPE, f"unknown message type {hdr.type!r}", rid) from None
        if isinstance(e, msgspec.ValidationError) and _BOUND.search(str(e)):
            raise ProtocolError(E_LIMIT, f"{hdr.type}: {e}", rid) from None
        raise ProtocolError(E_MALFORMED, f"{hdr.type}: {e}", rid) from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(E_VERSION, f"protocol version {msg.v}, expected {PROTOCOL_VERSION}", msg.rid)
    return msg


def decode_request(buf: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Request:
    """Decode and validate one request; raises ProtocolError (with the rid when it could be read)."""
    return _decode(buf, _req_decoder, _REQ_TAGS, max_bytes)  # type: ignore[no-any-return]


def decode_reply(buf: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Reply:
    return _decode(buf, _rep_decoder, _REP_TAGS, max_bytes)  # type: ignore[no-any-return]


def decode_events(buf: bytes | memoryview) -> EventBatch:
    try:
        return _event_decoder.decode(buf)
    except Exception as e:
        raise ProtocolError(E_MALFORMED, f"bad event batch: {e}") from None
