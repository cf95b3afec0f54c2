"""The request decoder under hostile frames (hypothesis): any bytes, and any map that looks like a request,
either decode to a valid request or are refused with a ProtocolError naming a known code and its cause."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbm import protocol as p
from kvbm.chaos.fuzz import KNOWN_CODES

REQUESTS = sorted(c.__name__ for c in p.Request.__args__)  # type: ignore[attr-defined]
FIELDS = sorted({f for c in p.Request.__args__ for f in c.__struct_fields__}  # type: ignore[attr-defined]
                | {"model", "num_layers", "dtype", "layout", "pad"})

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.sampled_from(FIELDS), inner, max_size=6)),
                      max_leaves=20)
requestish = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(REQUESTS), scalars), "v": st.one_of(st.just(p.PROTOCOL_VERSION), scalars),
     "rid": st.one_of(st.integers(min_value=0, max_value=2**32), scalars)},
    optional={f: values for f in FIELDS if f not in ("type", "v", "rid")})


def _decodes_or_names_its_refusal(buf: bytes) -> None:
    try:
        msg = p.decode_request(buf, max_bytes=1 << 16)
    except p.ProtocolError as e:
        assert e.code in KNOWN_CODES, e.code
        assert e.message.strip(), e
        assert isinstance(e.rid, int)
        return
    assert isinstance(msg, p.Request.__args__)  # type: ignore[attr-defined]
    assert msg.v == p.PROTOCOL_VERSION


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_are_refused_by_name(buf: bytes) -> None:
    _decodes_or_names_its_refusal(buf)


@settings(max_examples=600, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(requestish)
def test_request_shaped_maps_decode_or_are_refused_by_name(doc: dict) -> None:
    _decodes_or_names_its_refusal(msgspec.msgpack.encode(doc))


@settings(max_examples=300, derandomize=True)
@given(requestish, st.integers(min_value=0, max_value=400))
def test_truncated_requests_are_refused_by_name(doc: dict, cut: int) -> None:
    buf = msgspec.msgpack.encode(doc)
    _decodes_or_names_its_refusal(buf[: min(cut, len(buf))])
