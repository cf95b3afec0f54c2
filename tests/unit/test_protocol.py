"""The wire protocol: every message round-trips; bad frames raise a typed ProtocolError."""

import msgspec
import pytest

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout

LAYOUT = KVLayout(model="tiny", num_layers=2, num_kv_heads=2, head_size=64, dtype="float16", block_bytes=65536)
H = [bytes([i]) * 32 for i in range(3)]

REQUESTS = [
    p.Register(worker_id="w", engine_id="e", layout=LAYOUT, tp_rank=1, tp_size=2, g1_capacity_blocks=10),
    p.Unregister(token="t"),
    p.Ping(token="t"),
    p.Lookup(token="t", namespace="ns", hashes=H),
    p.PrepareStore(token="t", namespace="ns", hashes=H, nbytes=4096, generation="g1"),
    p.CommitStore(token="t", namespace="ns", hashes=H, ok=False, durable=True),
    p.Onboard(token="t", namespace="ns", hashes=H),
    p.Release(token="t", namespace="ns", hashes=H),
    p.Stats(token="t"),
    p.Barrier(token="t", engine_id="e", step=7, rank=1, world_size=2, timeout_s=1.5),
    p.Barrier(token="t", engine_id="e", step="req-1", rank=0),
    p.Evict(token="t", namespace="ns"),
    p.Evict(token="t", namespace="ns", hashes=H, tiers=["G2"]),
]
REPLIES = [
    p.Registered(token="t", namespace="ns", shm_name="s", generation="g1", slot_bytes=1, num_slots=2,
                 capacity_bytes=2, block_nbytes=1),
    p.Pong(),
    p.LookupReply(matched=2, tiers=["G2", "G3"]),
    p.Slots(slots=[0, None, 5]),
    p.Shed(retry_after_ms=50),
    p.Ack(stored=3, durable=2),
    p.Onboarded(count=2, slots=[1, 2], nbytes=[10, 10]),
    p.Released(count=1),
    p.StatsReply(stats={"tiers": [{"tier": "G2", "blocks": 1}], "x": 1.5}),
    p.BarrierReply(arrived=2, complete=True),
    p.Evicted(removed=1, skipped=2),
    p.Error(code="malformed", message="m"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip_with_rid_and_version(msg):
    msg.rid = 42
    buf = p.encode(msg)
    raw = msgspec.msgpack.decode(buf)
    assert raw["type"] == type(msg).__name__ and raw["v"] == p.PROTOCOL_VERSION and raw["rid"] == 42
    assert p.decode_request(buf) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg):
    msg.rid = 7
    assert p.decode_reply(p.encode(msg)) == msg


def test_block_keys_of_a_request():
    assert p.Lookup(namespace="ns", hashes=H).keys() == [BlockKey("ns", h) for h in H]


def _code(buf, **kw):
    with pytest.raises(p.ProtocolError) as ei:
        p.decode_request(buf, **kw)
    return ei.value.code, ei.value.rid


def test_bad_frames_raise_typed_errors_with_the_rid_when_readable():
    V = p.PROTOCOL_VERSION
    good = p.encode(p.Lookup(rid=9, token="t", namespace="ns", hashes=H))
    assert _code(b"")[0] == p.E_MALFORMED
    assert _code(b"\xc1garbage")[0] == p.E_MALFORMED
    assert _code(good[:-5])[0] == p.E_MALFORMED
    assert _code(msgspec.msgpack.encode([1, 2, 3]))[0] == p.E_MALFORMED
    assert _code(msgspec.msgpack.encode({"type": "Lookup", "v": V + 1, "rid": 3})) == (p.E_VERSION, 3)
    assert _code(msgspec.msgpack.encode({"type": "Lookup", "v": 1, "rid": 3, "namespace": "n", "hashes": []})) == (
        p.E_VERSION, 3)  # a version-1 client (no pool generation) is refused, not half understood
    assert _code(msgspec.msgpack.encode({"type": "Nope", "v": V, "rid": 4})) == (p.E_UNKNOWN_TYPE, 4)
    assert _code(msgspec.msgpack.encode({"v": V, "rid": 4})) == (p.E_UNKNOWN_TYPE, 4)
    assert _code(msgspec.msgpack.encode({"type": "Lookup", "v": V, "rid": 5, "namespace": 1, "hashes": []})) == (
        p.E_MALFORMED, 5)
    # A layout that fails its own validation is a malformed Register, not a crash.
    bad_layout = msgspec.msgpack.encode({"type": "Register", "v": V, "rid": 6, "worker_id": "w", "engine_id": "e",
                                         "layout": {"model": "m", "num_layers": 0, "num_kv_heads": 1, "head_size": 1}})
    assert _code(bad_layout) == (p.E_MALFORMED, 6)
    assert _code(good, max_bytes=len(good) - 1)[0] == p.E_TOO_LARGE
    # Replies are not requests.
    assert _code(p.encode(p.Pong(rid=1)))[0] == p.E_UNKNOWN_TYPE


def test_encode_refuses_oversized_messages():
    with pytest.raises(p.ProtocolError) as ei:
        p.encode(p.Lookup(namespace="ns", hashes=[b"x" * 32] * 1000), max_bytes=1000)
    assert ei.value.code == p.E_TOO_LARGE


def test_unknown_trailing_fields_are_tolerated_for_forward_compatibility():
    raw = msgspec.msgpack.decode(p.encode(p.Ping(rid=3, token="t")))
    raw["future_field"] = [1, 2]
    assert p.decode_request(msgspec.msgpack.encode(raw)) == p.Ping(rid=3, token="t")


def test_event_batches_round_trip():
    batch = p.EventBatch(ts=1.0, events=[p.BlocksStored(namespace="ns", hashes=H),
                                         p.BlocksRemoved(namespace="ns", hashes=H[:1], tier="G3"),
                                         p.BlocksOnboarded(namespace="ns", hashes=H, worker_id="w")])
    assert p.decode_events(p.encode(batch)) == batch
    with pytest.raises(p.ProtocolError):
        p.decode_events(b"\x01")


def test_every_field_is_bounded_with_a_typed_error():
    V = p.PROTOCOL_VERSION
    assert (p.E_LIMIT, p.E_FORBIDDEN) == ("limit", "forbidden")  # the codes tests/integration/test_security.py asserts

    def lookup(**kw):
        return msgspec.msgpack.encode({"type": "Lookup", "v": V, "rid": 7, "namespace": "ns", "hashes": [], **kw})

    assert p.decode_request(lookup(hashes=[b"h" * 32] * p.MAX_BATCH)).rid == 7  # at the bounds: fine
    assert _code(lookup(hashes=[b"h"] * (p.MAX_BATCH + 1)), max_bytes=1 << 30) == (p.E_LIMIT, 7)
    assert _code(lookup(hashes=[b"h" * (p.MAX_HASH_BYTES + 1)])) == (p.E_LIMIT, 7)
    assert _code(lookup(hashes=[b""])) == (p.E_LIMIT, 7)
    assert _code(lookup(namespace="n" * (p.MAX_STR + 1))) == (p.E_LIMIT, 7)
    assert _code(lookup(token="t" * (p.MAX_STR + 1))) == (p.E_LIMIT, 7)
    reg = {"type": "Register", "v": V, "rid": 8, "worker_id": "w", "engine_id": "e",
           "layout": msgspec.to_builtins(p.KVLayout(model="m", num_layers=1, num_kv_heads=1, head_size=1))}
    for field, bad in (("worker_id", "w" * 300), ("engine_id", "e" * 300), ("admin_token", "a" * 300),
                       ("tp_rank", -1), ("tp_size", p.MAX_RANKS + 1), ("g1_capacity_blocks", -5)):
        assert _code(msgspec.msgpack.encode({**reg, field: bad})) == (p.E_LIMIT, 8), field
    barrier = {"type": "Barrier", "v": V, "rid": 9, "engine_id": "e", "step": 1, "rank": 0}
    for field, bad in (("rank", -1), ("world_size", p.MAX_RANKS + 1), ("timeout_s", -1.0), ("step", "s" * 300)):
        assert _code(msgspec.msgpack.encode({**barrier, field: bad}))[0] in (p.E_LIMIT, p.E_MALFORMED), field
    assert _code(msgspec.msgpack.encode({**barrier, "rank": -1})) == (p.E_LIMIT, 9)
    evict = {"type": "Evict", "v": V, "rid": 10, "namespace": "ns"}
    assert _code(msgspec.msgpack.encode({**evict, "tiers": ["G2"] * (p.MAX_TIERS + 1)})) == (p.E_LIMIT, 10)
    prep = {"type": "PrepareStore", "v": V, "rid": 11, "namespace": "ns", "hashes": [b"x"], "nbytes": -1}
    assert _code(msgspec.msgpack.encode(prep)) == (p.E_LIMIT, 11)
    # A wrong type is still malformed, not a limit.
    assert _code(lookup(hashes="nope"))[0] == p.E_MALFORMED
