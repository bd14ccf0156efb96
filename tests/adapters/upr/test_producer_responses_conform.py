"""What a producer connection does with each response a consumer sends it.

ep-engine 3.0 src/upr-producer.cc ``UprProducer::handleResponse`` (memcached
3.0 daemon/memcached.c hands every response on a UPR connection to it):
SET_VBUCKET_STATE and SNAPSHOT_MARKER go to the stream with that opaque,
whatever their status (none: ignored); MUTATION, DELETION, EXPIRATION and
STREAM_END are ignored; NOOP's clears the NOOP outstanding when its opaque is
the last NOOP's; any other response, or a NOOP response with another opaque,
"Trying to handle an unknown response": the connection is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters import upr
from adapters.mcbp import FrameReader, Magic, encode_frame
from adapters.upr import producer_machine as pm
from adapters.upr.producer_machine import ProducerMachine


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


def machine() -> ProducerMachine[FakeStream]:
    return ProducerMachine("consumer", upr.DCP, noop_interval=10.0)


def response(opcode: int, opaque: int, status: int = 0, extras: bytes = b"") -> pm.Frame:
    reader = FrameReader()
    reader.receive_data(
        encode_frame(Magic.RESPONSE, opcode, opaque=opaque, vbucket_or_status=status, extras=extras)
    )
    (frame,) = reader.frames()
    return frame


@pytest.mark.parametrize("opcode", [0x55, 0x57, 0x58, 0x59])
def test_item_and_stream_end_responses_are_ignored(opcode: int) -> None:
    m = machine()
    assert m.receive_frame(response(opcode, 5), 0.0) == ()
    assert m.receive_frame(response(opcode, 5, status=0x86), 0.0) == ()


@pytest.mark.parametrize("opcode", [0x56, 0x5B])
@pytest.mark.parametrize("status", [0, 0x04, 0x86])
def test_state_and_marker_replies_reach_their_stream_whatever_the_status(
    opcode: int, status: int
) -> None:
    m = machine()
    stream = FakeStream(opaque=9)
    m.add_stream(3, stream)
    (out,) = m.receive_frame(response(opcode, 9, status), 0.0)
    assert isinstance(out, pm.Deliver) and out.stream is stream
    assert m.receive_frame(response(opcode, 10, status), 0.0) == ()  # no such stream


@pytest.mark.parametrize(
    ("opcode", "extras"),
    [
        (0x50, b""),  # OPEN
        (0x51, b"\0\0\0\1"),  # ADD_STREAM
        (0x52, b""),  # CLOSE_STREAM
        (0x53, b""),  # STREAM_REQ
        (0x54, b""),  # GET_FAILOVER_LOG
        (0x5A, b""),  # FLUSH
        (0x5D, b""),  # BUFFER_ACKNOWLEDGEMENT
        (0x5E, b""),  # CONTROL
    ],
)
def test_a_response_no_producer_expects_drops_the_connection(opcode: int, extras: bytes) -> None:
    m = machine()
    (out,) = m.receive_frame(response(opcode, 5, extras=extras), 0.0)
    assert isinstance(out, pm.Fail)
    assert out.error.opcode == opcode and out.error.field == "opcode"


def test_a_noop_response_must_answer_the_last_noop() -> None:
    m = machine()
    # None sent yet: nothing to answer.
    (out,) = m.receive_frame(response(0x5C, 77), 0.0)
    assert isinstance(out, pm.Fail) and out.error.field == "opaque" and out.error.value == 77
    m.receive(upr.Control(b"enable_noop", b"true", opaque=1), 0.0)
    noop = m.on_timer(10.0)
    reader = FrameReader()
    reader.receive_data(noop)
    (sent,) = reader.frames()
    assert m.receive_frame(response(0x5C, sent.opaque + 1), 10.5)[0].__class__ is pm.Fail
    assert m.receive_frame(response(0x5C, sent.opaque), 10.5) == ()
    assert m.receive_frame(response(0x5C, sent.opaque), 10.6) == ()  # again: still the last
    assert m.on_timer(20.0)  # answered: the next NOOP goes, no drop
