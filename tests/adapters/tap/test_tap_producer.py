"""The TAP producer's sequence numbers, ack requests and retransmit window."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from adapters.errors import LocalProtocolError, ProtocolError
from adapters.mcbp import FrameReader, Magic, Status, encode_frame
from adapters.tap import (
    OpaqueCode,
    TapCheckpointStart,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapOpcode,
    TapResponse,
    encode,
)
from adapters.tap.producer import ProducerState, TapProducer, successful_acks


def mutation(i: int) -> TapMutation:
    return TapMutation(b"k%d" % i, b"v")


def ack(seqno: int, status: int = 0) -> TapResponse:
    return TapResponse(TapOpcode.MUTATION, opaque=seqno, status=status)


def test_sequence_numbers_and_ack_requests() -> None:
    producer = TapProducer(support_ack=True, ack_interval=3, max_unacked=6)
    sent = [producer.stamp(mutation(i)) for i in range(3)]
    assert [m.opaque for m in sent] == [1, 2, 3]
    assert [bool(m.tap_flags & TapFlags.ACK) for m in sent] == [False, False, True]
    opaque = producer.stamp(TapOpaque(OpaqueCode.CLOSE_BACKFILL))
    checkpoint = producer.stamp(TapCheckpointStart(1))
    assert opaque.tap_flags & TapFlags.ACK and checkpoint.tap_flags & TapFlags.ACK
    assert producer.unacked == 5


def test_ack_releases_everything_up_to_it() -> None:
    producer = TapProducer(support_ack=True, ack_interval=2, max_unacked=4)
    sent = [producer.stamp(mutation(i)) for i in range(4)]
    assert not producer.can_send
    with pytest.raises(LocalProtocolError):
        producer.stamp(mutation(9))
    assert producer.receive(ack(2), now=0) == sent[:2]
    assert producer.can_send and producer.unacked == 2
    assert producer.receive(ack(1), now=0) == []  # late ack, already covered
    assert producer.receive(ack(4), now=0) == sent[2:]


def test_busy_nack_backs_off_then_resends_in_order() -> None:
    producer = TapProducer(support_ack=True, ack_interval=2, backoff=5.0)
    sent = [producer.stamp(mutation(i)) for i in range(3)]
    # ep-engine 2.5.1 src/tapconnection.cc ``TapProducer::processAck``: a busy nack
    # acks what came before it, suspends the stream and sends the nacked again.
    assert producer.receive(ack(2, Status.BUSY), now=100.0) == sent[:1]
    assert producer.state is ProducerState.BACKING_OFF and not producer.can_send
    assert producer.next_deadline() == 105.0
    assert producer.retransmit_due(104.9) == []
    assert producer.retransmit_due(105.0) == sent[1:]
    assert producer.can_send and producer.retransmits_total == 2


def test_other_nack_is_fatal() -> None:
    producer = TapProducer(support_ack=True)
    producer.stamp(mutation(0))
    with pytest.raises(ProtocolError, match="refused") as info:
        producer.receive(ack(1, Status.KEY_EXISTS), now=0)
    assert info.value.value == Status.KEY_EXISTS
    assert producer.state is ProducerState.FAILED


def test_ack_for_unsent_sequence_number_changes_nothing() -> None:
    """ep-engine 2.5.1 src/tapconnection.cc ``TapProducer::processAck``: an ack not
    in the ack log is logged ("Explicit ack of nonexisting entry") and the
    connection goes on."""
    producer = TapProducer(support_ack=True)
    producer.stamp(mutation(0))
    assert producer.receive(ack(7), now=0) == []
    assert producer.unacked == 1 and producer.stray_acks == 1
    assert producer.state is ProducerState.STREAMING


def test_without_support_ack_nothing_is_kept() -> None:
    """ep-engine 2.x tapconnection.cc ``TapProducer::processAck`` works the same
    with or without support-ack: an ack finds nothing in the (empty) ack log,
    a busy nack suspends the stream, any other nack disconnects."""
    producer = TapProducer(support_ack=False, ack_interval=1, max_unacked=1, backoff=1)
    for i in range(10):
        assert not producer.stamp(mutation(i)).tap_flags & TapFlags.ACK
    assert producer.unacked == 0 and producer.can_send
    assert producer.receive(ack(1), now=0) == []  # the classic client acks everything
    assert producer.can_send
    assert producer.receive(ack(2, Status.BUSY), now=0) == []
    assert not producer.can_send and producer.next_deadline() == 1
    assert producer.retransmit_due(1) == [] and producer.can_send
    with pytest.raises(ProtocolError, match="refused"):
        producer.receive(ack(3, Status.KEY_EXISTS), now=2)
    assert producer.state is ProducerState.FAILED


class ProducerMachine(RuleBasedStateMachine):
    """Random sends, acks and nacks against a model of what is outstanding."""

    def __init__(self) -> None:
        super().__init__()
        self.producer = TapProducer(support_ack=True, ack_interval=4, max_unacked=12, backoff=1)
        self.model: list[int] = []
        self.now = 0.0
        self.sent = 0

    @precondition(lambda self: self.producer.can_send)
    @rule()
    def send(self) -> None:
        message = self.producer.stamp(mutation(self.sent))
        self.sent += 1
        assert message.opaque == self.sent
        self.model.append(message.opaque)

    @precondition(lambda self: self.model and self.producer.state is ProducerState.STREAMING)
    @rule(data=st.data())
    def ack_some(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.model) - 1))
        released = self.producer.receive(ack(self.model[index]), self.now)
        assert [m.opaque for m in released] == self.model[: index + 1]
        del self.model[: index + 1]

    @precondition(lambda self: self.model and self.producer.state is ProducerState.STREAMING)
    @rule(data=st.data())
    def nack_busy(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.model) - 1))
        released = self.producer.receive(ack(self.model[index], Status.TEMPORARY_FAILURE), self.now)
        assert [m.opaque for m in released] == self.model[:index]
        del self.model[:index]

    @rule(dt=st.floats(0, 2))
    def tick(self, dt: float) -> None:
        self.now += dt
        resent = self.producer.retransmit_due(self.now)
        assert [m.opaque for m in resent] in ([], self.model)

    @invariant()
    def window_matches_model(self) -> None:
        assert self.producer.unacked == len(self.model) <= 12


TestProducerMachine = ProducerMachine.TestCase


def test_request_ack_on_last_marks_the_newest_outstanding_message() -> None:
    from adapters.tap import TapMutation

    producer = TapProducer(support_ack=True, ack_interval=100)
    producer.stamp(TapMutation(b"a", b"1"))
    second = producer.stamp(TapMutation(b"b", b"2"))
    assert not second.tap_flags & TapFlags.ACK
    asked = producer.request_ack_on_last()
    assert asked.opaque == second.opaque and asked.tap_flags & TapFlags.ACK
    assert producer.request_ack_on_last() is asked
    released = producer.receive(TapResponse(TapOpcode.MUTATION, opaque=asked.opaque), now=0.0)
    assert [m.opaque for m in released] == [1, 2] and released[-1] == asked
    assert TapProducer(support_ack=False).stamp(TapMutation(b"c")).opaque == 1
    with pytest.raises(LocalProtocolError, match="no message"):
        TapProducer(support_ack=True).request_ack_on_last()


@st.composite
def ack_runs(draw: st.DrawFn) -> tuple[int, list[int]]:
    """How many messages were sent, and the acks of one client read (late ones too)."""
    sent = draw(st.integers(1, 40))
    return sent, draw(st.lists(st.integers(1, sent), min_size=1, max_size=6))


@given(ack_runs(), st.booleans())
def test_acks_of_one_read_release_what_they_release_one_by_one(
    run: tuple[int, list[int]], frames: bool
) -> None:
    """``release_acks`` (the TAP front's acks of one read) against ``receive`` per ack,
    for messages and for kept frame bytes alike."""
    sent, acks = run
    one_by_one = TapProducer(support_ack=True, ack_interval=3, max_unacked=64)
    together = TapProducer(support_ack=True, ack_interval=3, max_unacked=64)
    for i in range(sent):
        one_by_one.stamp(mutation(i))
        if frames:
            seqno, flags = together.next_stamp(0)
            together.keep(encode(replace(mutation(i), opaque=seqno, tap_flags=TapFlags(flags))))
        else:
            together.stamp(mutation(i))
    released = sum(len(one_by_one.receive(ack(seqno), now=0)) for seqno in acks)
    assert together.release_acks(list(acks)) == released
    assert together.unacked == one_by_one.unacked
    assert together.first_unacked == (one_by_one.oldest_unacked.opaque if one_by_one.unacked else 0)  # type: ignore[union-attr]
    assert together.retransmit_frames(0) == []  # nothing to resend while streaming


def test_acks_of_one_read_naming_a_number_never_sent_ignore_it() -> None:
    producer = TapProducer(support_ack=True)
    producer.stamp(mutation(0))
    producer.stamp(mutation(1))
    assert producer.release_acks([1, 9]) == 1
    assert producer.unacked == 1 and producer.stray_acks == 1


def test_kept_frames_are_resent_and_asked_for_an_ack_as_bytes() -> None:
    """A kept frame's ack request sets the ACK flag in its bytes; a resend sends the
    frames as they were last sent, messages encoded beside them, in order."""
    producer = TapProducer(support_ack=True, ack_interval=100, backoff=1)
    seqno, flags = producer.next_stamp(0)
    frame = encode(replace(mutation(0), opaque=seqno, tap_flags=TapFlags(flags)))
    producer.keep(frame)
    message = producer.stamp(mutation(1))
    seqno, flags = producer.next_stamp(0)
    last = encode(replace(mutation(2), opaque=seqno, tap_flags=TapFlags(flags)))
    producer.keep(last)
    asked = producer.ack_request_on_last()
    assert asked == encode(replace(mutation(2), opaque=3, tap_flags=TapFlags.ACK))
    assert producer.last_opaque == 3
    producer.receive(ack(1, Status.BUSY), now=0)
    assert producer.retransmit_frames(1) == [frame, encode(message), asked]


_ACK_FRAMES = st.one_of(
    st.builds(
        lambda op, opaque, body: encode_frame(
            Magic.RESPONSE, op, opaque=opaque, value=body, extras_length=0
        ),
        st.sampled_from([op.value for op in TapOpcode]),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=6),
    ),
    st.builds(
        lambda opaque, status: encode_frame(
            Magic.RESPONSE, TapOpcode.MUTATION.value, opaque=opaque, vbucket_or_status=status
        ),
        st.integers(0, 2**32 - 1),
        st.integers(1, 0xFFFF),
    ),
    st.just(encode_frame(Magic.REQUEST, 0x0A)),  # a NOOP request
    st.just(encode_frame(Magic.RESPONSE, 0x0A, opaque=3)),  # not a TAP opcode
)


@given(st.lists(_ACK_FRAMES, max_size=12), st.integers(0, 400), st.integers(0, 64))
def test_successful_acks_read_what_the_frame_reader_reads(
    frames: list[bytes], cut: int, max_body: int
) -> None:
    """The peer's successful acks scanned in place are the opaques, in order, of the
    frames a lenient reader hands out up to the first that is not one (nack,
    request, another opcode, a frame not whole or over the size limit)."""
    data = b"".join(frames)[:cut]
    opaques: list[int] = []
    end = successful_acks(data, 0, opaques, max_body)
    reader = FrameReader(max_body, lenient_responses=True)
    reader.receive_data(data)
    expected: list[int] = []
    offset = 0
    while True:
        try:
            frame = reader.next_frame()
        except ProtocolError:
            break
        taps = {op.value for op in TapOpcode}
        if frame is None or frame.magic != Magic.RESPONSE or frame.opcode not in taps:
            break
        if frame.vbucket_or_status:
            break
        expected.append(frame.opaque)
        offset += frame.size
    assert (opaques, end) == (expected, offset)
