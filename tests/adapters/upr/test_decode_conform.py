"""Request shapes as memcached 3.0 daemon/memcached.c validates them
(``dcp_open_validator``, ``dcp_stream_req_validator``, ...).

OPEN must have 8 bytes of extras and a name, STREAM_REQ 48 bytes of extras
and no key; neither validator looks at the body length, so a value after
them passes and the engine never reads it. Taken here too, the value
ignored. The validators that do fix the body (CLOSE_STREAM,
GET_FAILOVER_LOG, BUFFER_ACKNOWLEDGEMENT, FLUSH, NOOP) stay as strict.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, FrameReader, Magic, encode_frame
from adapters.upr import producer_machine as pm


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


def frame_of(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


def test_an_open_with_a_value_is_taken_the_value_ignored() -> None:
    data = encode_frame(
        Magic.REQUEST, 0x50, key=b"name", extras=struct.pack(">II", 0, 1), value=b"{}", opaque=3
    )
    event = upr.decode_frame(frame_of(data), upr.DCP)
    assert event == upr.Open(name=b"name", flags=upr.OpenFlags.PRODUCER, opaque=3)


def test_a_stream_request_with_a_value_is_taken_the_value_ignored() -> None:
    extras = struct.pack(">IIQQQQQ", 0, 0, 5, 50, 77, 5, 5)
    data = encode_frame(
        Magic.REQUEST, 0x53, extras=extras, value=b"{}", vbucket_or_status=2, opaque=4
    )
    event = upr.decode_frame(frame_of(data), upr.DCP)
    assert event == upr.StreamRequest(
        start_seqno=5,
        end_seqno=50,
        vbucket_uuid=77,
        snap_start_seqno=5,
        snap_end_seqno=5,
        opaque=4,
        vbucket=2,
    )


@pytest.mark.parametrize("opcode", [0x52, 0x54, 0x5A, 0x5C])
def test_requests_whose_body_is_fixed_stay_strict(opcode: int) -> None:
    with pytest.raises(ProtocolError):
        upr.decode_frame(frame_of(encode_frame(Magic.REQUEST, opcode, value=b"x")), upr.DCP)


def test_a_stream_request_with_a_key_stays_malformed() -> None:
    extras = struct.pack(">IIQQQQQ", 0, 0, 0, 1, 0, 0, 0)
    data = encode_frame(Magic.REQUEST, 0x53, extras=extras, key=b"k")
    with pytest.raises(ProtocolError):
        upr.decode_frame(frame_of(data), upr.DCP)


def test_stream_request_flags_3_0_does_not_know_are_kept_and_served() -> None:
    """upr-producer.cc ``streamRequest`` reads only the flag bits it knows
    (TAKEOVER, DISKONLY, LATEST) and refuses none: a request with others streams."""
    extras = struct.pack(">IIQQQQQ", 0x80 | 0x10, 0, 0, 10, 0, 0, 0)
    frame = frame_of(encode_frame(Magic.REQUEST, 0x53, extras=extras, opaque=6))
    m: pm.ProducerMachine[FakeStream] = pm.ProducerMachine("c", upr.DCP, noop_interval=10.0)
    (out,) = m.receive_frame(frame, 0.0)
    assert isinstance(out, pm.StreamWanted) and out.request.flags == 0x90
    assert not out.request.flags & (upr.StreamFlags.TAKEOVER | upr.StreamFlags.LATEST)
