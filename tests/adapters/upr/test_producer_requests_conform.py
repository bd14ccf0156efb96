"""Requests a consumer may not send a producer.

ep-engine 3.0 src/tapconnection.cc ``ConnHandler``: the producer overrides
only streamRequest, getFailoverLog, closeStream, bufferAcknowledgement and
control (src/upr-producer.cc); every other UPR request on a producer
connection (ADD_STREAM, STREAM_END, SNAPSHOT_MARKER, MUTATION, DELETION,
EXPIRATION, FLUSH, SET_VBUCKET_STATE, NOOP) logs "Disconnecting - This
connection doesn't support the ... API" and returns ENGINE_DISCONNECT:
memcached closes the connection without a reply.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.upr import producer_machine as pm
from adapters.upr.producer_machine import ProducerMachine


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


NOT_FOR_A_PRODUCER = [
    upr.AddStream(upr.StreamFlags(0), opaque=4, vbucket=1),
    upr.StreamEnd(upr.StreamEndReason.OK, opaque=4, vbucket=1),
    upr.SnapshotMarker(start_seqno=1, end_seqno=2, opaque=4, vbucket=1),
    upr.Mutation(key=b"k", value=b"v", by_seqno=1, opaque=4, vbucket=1),
    upr.Deletion(key=b"k", by_seqno=1, opaque=4, vbucket=1),
    upr.Expiration(key=b"k", by_seqno=1, opaque=4, vbucket=1),
    upr.Flush(opaque=4, vbucket=1),
    upr.SetVbucketState(upr.VBucketState.ACTIVE, opaque=4, vbucket=1),
    upr.Noop(opaque=4),
]


@pytest.mark.parametrize("event", NOT_FOR_A_PRODUCER, ids=lambda e: e.NAME)
def test_a_request_for_a_consumer_closes_a_producer_connection_unanswered(
    event: upr.UprEvent,
) -> None:
    m: ProducerMachine[FakeStream] = ProducerMachine("consumer", upr.DCP, noop_interval=10.0)
    m.add_stream(1, FakeStream(opaque=4))
    reader = FrameReader()
    reader.receive_data(upr.encode(event))
    (frame,) = reader.frames()
    (out,) = m.receive_frame(frame, 0.0)
    assert isinstance(out, pm.Fail)
    assert out.error.field == "opcode" and out.error.opcode == frame.opcode
    assert event.NAME in str(out.error)


def test_a_second_open_closes_the_connection_unanswered() -> None:
    """ep-engine 3.x (after 3.0.0) src/ep_engine.cc ``dcpOpen``: "Cannot open DCP
    connection as another connection exists on the same socket",
    ENGINE_DISCONNECT. 3.0.0's ``uprOpen`` put a second handler over the first."""
    m: ProducerMachine[FakeStream] = ProducerMachine("consumer", upr.DCP, noop_interval=10.0)
    reader = FrameReader()
    reader.receive_data(upr.encode(upr.Open(name=b"again", flags=upr.OpenFlags.PRODUCER)))
    (frame,) = reader.frames()
    (out,) = m.receive_frame(frame, 0.0)
    assert isinstance(out, pm.Fail) and out.error.opcode == 0x50
    assert "open already" in str(out.error)
