"""UPR requests before OPEN, as ep-engine 3.0 src/ep_engine.cc takes them.

Each UPR entry point (``EvpUprStreamReq``, ``EvpUprGetFailoverLog``, ...)
looks up the connection's handler, finds none before OPEN, and returns
ENGINE_DISCONNECT: memcached 3.0 daemon/memcached.c closes the connection
without a reply. Only the pre-release draft, which has no OPEN, opens a
producer with its first STREAM_REQ or GET_FAILOVER_LOG.

``dcpOpen`` tests PRODUCER (0x01) before NOTIFIER (0x02): an OPEN with both
opens a producer; NOTIFIER alone a notifier (a producer whose streams only
tell when their vbucket passes their start).
"""

from __future__ import annotations

import pytest

from adapters import upr
from adapters.mcbp import Frame, FrameReader, Status
from adapters.upr.opening import Role, notifies_only, open_connection

BEFORE_OPEN = [
    upr.StreamRequest(vbucket=1, opaque=3),
    upr.GetFailoverLog(vbucket=1, opaque=3),
    upr.CloseStream(vbucket=1, opaque=3),
    upr.Control(b"connection_buffer_size", b"1024", opaque=3),
    upr.BufferAcknowledgement(buffer_bytes=10, opaque=3),
    upr.Noop(opaque=3),
    upr.Mutation(key=b"k", value=b"v", by_seqno=1, opaque=3, vbucket=1),
]


def frame_of(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


@pytest.mark.parametrize("event", BEFORE_OPEN, ids=lambda e: e.NAME)
def test_a_upr_request_before_open_closes_unanswered(event: upr.UprEvent) -> None:
    frame = frame_of(upr.encode(event))
    opening = open_connection(frame, upr.DCP, "peer", consumers=True)
    assert opening.role is None and opening.reply == b""
    assert opening.closing is not None
    assert opening.closing.opcode == frame.opcode and opening.closing.field == "opcode"
    assert "needs an open UPR connection" in str(opening.closing)


@pytest.mark.parametrize(
    ("flags", "role"),
    [
        (upr.OpenFlags.PRODUCER | upr.OpenFlags.NOTIFIER, Role.PRODUCER),
        (upr.OpenFlags.NOTIFIER, Role.PRODUCER),
    ],
)
def test_producer_comes_before_notifier(flags: upr.OpenFlags, role: Role) -> None:
    frame = frame_of(upr.encode(upr.Open(name=b"n", flags=flags, opaque=5)))
    opening = open_connection(frame, upr.DCP, "peer", consumers=True)
    assert opening.role is role
    assert notifies_only(opening.flags) == (flags == upr.OpenFlags.NOTIFIER)
    assert frame_of(opening.reply).vbucket_or_status == Status.SUCCESS
