"""The first UPR request on a command connection (``adapters.upr.opening``).

As memcached v3.0.0 daemon/memcached.c and ep-engine v3.0.0 src/ep_engine.cc
(``uprOpen``) take it: OPEN with the producer or the notifier flag makes a
producer (a notifier one with the notifier flag alone), no flag a consumer
where the role has one; the pre-release draft has no OPEN, so its first STREAM_REQ or
GET_FAILOVER_LOG opens a producer named after the peer.
"""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import Frame, FrameReader, Magic, Status, encode_frame
from adapters.upr.opening import Role, notifies_only, open_connection


def frame_of(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


def answer(data: bytes) -> Frame:
    return frame_of(data)


@given(
    flags=st.integers(0, 0xFF),
    name=st.binary(min_size=1, max_size=20),
    consumers=st.booleans(),
    opaque=st.integers(0, 0xFFFFFFFF),
)
def test_open_makes_a_producer_a_consumer_or_a_refusal(
    flags: int, name: bytes, consumers: bool, opaque: int
) -> None:
    event = upr.Open(name=name, flags=upr.OpenFlags(flags), opaque=opaque)
    opening = open_connection(frame_of(upr.encode(event)), upr.DCP, "peer", consumers=consumers)
    reply = answer(opening.reply)
    assert reply.magic == Magic.RESPONSE and reply.opaque == opaque
    assert opening.closing is None
    if flags & (upr.OpenFlags.PRODUCER | upr.OpenFlags.NOTIFIER):
        assert opening.role is Role.PRODUCER and reply.vbucket_or_status == 0
        assert notifies_only(opening.flags) == (not flags & upr.OpenFlags.PRODUCER)
    elif not consumers:
        assert opening.role is None and reply.vbucket_or_status == Status.NOT_SUPPORTED
    else:
        assert opening.role is Role.CONSUMER and reply.vbucket_or_status == 0
    if opening.role is not None:
        assert opening.name == name.decode("utf-8", "replace") and opening.opened == event


@given(vbucket=st.integers(0, 1023), draft=st.booleans())
def test_a_first_stream_request_opens_only_in_the_draft(vbucket: int, draft: bool) -> None:
    dialect = upr.UPR_DRAFT if draft else upr.DCP
    event = upr.GetFailoverLog(vbucket=vbucket, opaque=4)
    opening = open_connection(
        frame_of(upr.encode(event, dialect)), dialect, "1.2.3.4:5", consumers=True
    )
    if draft:
        assert opening.role is Role.PRODUCER and opening.first == event
        assert opening.name == "upr-draft:1.2.3.4:5" and not opening.reply
    else:  # before OPEN: closed unanswered (test_opening_conform.py)
        assert opening.role is None and not opening.reply and opening.closing is not None


def test_a_malformed_first_request_is_answered_and_closes() -> None:
    bad = encode_frame(Magic.REQUEST, 0x50, opaque=6, extras=struct.pack(">I", 1))  # OPEN: 4 of 8
    opening = open_connection(frame_of(bad), upr.DCP, "peer", consumers=True)
    assert opening.role is None and opening.closing is not None
    assert answer(opening.reply).vbucket_or_status == Status.INVALID_ARGUMENTS
