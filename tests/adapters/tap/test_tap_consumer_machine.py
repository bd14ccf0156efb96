"""The TAP consumer machine against a model of what a 2.x consumer answers.

memcached 2.x daemon/memcached.c ``process_bin_tap_packet`` nacks an expired
TTL EINVAL before the engine sees the packet and answers a message with
TAP_FLAG_ACK once ep-engine's src/ep_engine.cc ``tapNotify`` applied it;
``process_bin_unknown_packet`` hands an unknown opcode to the engine, which
answers UNKNOWN_COMMAND. The model says, for each packet a producer may send,
what the machine decides and answers, for both consumers (the node, which
accepts a pushed stream, and the ingest, which dialed and sent the CONNECT).
"""

from __future__ import annotations

import struct
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from adapters.mcbp import Frame, FrameReader, Magic, Opcode, Status, encode_frame
from adapters.mcbp.constants import VBucketState
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDelete,
    TapFlags,
    TapFlush,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapStreamMessage,
    TapVbucketSet,
    decode_frame,
    encode,
    is_tap_opcode,
)
from adapters.tap.consumer_machine import Decision, Do, TapConsumerMachine

PEER = "peer 127.0.0.1:1"
OPCODE_OF = {
    TapMutation: TapOpcode.MUTATION,
    TapDelete: TapOpcode.DELETE,
    TapFlush: TapOpcode.FLUSH,
    TapVbucketSet: TapOpcode.VBUCKET_SET,
    TapCheckpointStart: TapOpcode.CHECKPOINT_START,
    TapCheckpointEnd: TapOpcode.CHECKPOINT_END,
    TapOpaque: TapOpcode.OPAQUE,
}
UNKNOWN_OPCODES = [op for op in range(0x20, 0x100) if not is_tap_opcode(op)]

opaques = st.integers(0, 2**32 - 1)
vbuckets = st.integers(0, 3) | st.integers(0, 1023)
ttls = st.one_of(st.just(0), st.integers(1, 255))
tap_flags = st.sampled_from([TapFlags(0), TapFlags.ACK, TapFlags.ACK | TapFlags.NETWORK_BYTE_ORDER])


@st.composite
def stream_messages(draw: st.DrawFn) -> TapStreamMessage:
    vb, opaque, flags, ttl = draw(vbuckets), draw(opaques), draw(tap_flags), draw(ttls)
    kind = draw(st.sampled_from(["mutation", "delete", "flush", "set", "start", "end"]))
    if kind == "mutation":
        return TapMutation(b"k", b"v", vb, opaque, tap_flags=flags, ttl=ttl)
    if kind == "delete":
        return TapDelete(b"k", vb, opaque, tap_flags=flags, ttl=ttl)
    if kind == "flush":
        return TapFlush(vb, opaque, flags, ttl)
    if kind == "set":
        return TapVbucketSet(draw(st.sampled_from(VBucketState)), vb, opaque, flags, ttl)
    cls = TapCheckpointStart if kind == "start" else TapCheckpointEnd
    return cls(draw(st.integers(0, 2**64 - 1)), vb, opaque, tap_flags=flags, ttl=ttl)


def frame_of(data: bytes) -> Frame:
    reader = FrameReader(lenient_responses=True)
    reader.receive_data(data)
    frame = reader.next_frame()
    assert frame is not None and reader.next_frame() is None
    return frame


def answer(decision: Decision) -> TapResponse | TapNoopResponse:
    event = decode_frame(frame_of(decision.reply))
    assert isinstance(event, TapResponse | TapNoopResponse)
    return event


class ConsumerModel(RuleBasedStateMachine):
    machine: TapConsumerMachine
    dialed: bool

    def __init__(self) -> None:
        super().__init__()
        self.messages = self.nacks = self.unknown = 0
        self.said: set[int] = set()
        self.closing = False
        self.backfill: set[int] = set()

    @initialize(dialed=st.booleans())
    def start(self, dialed: bool) -> None:
        self.dialed = dialed
        self.machine = TapConsumerMachine(PEER, dialed=dialed)

    def _stream(self, message: TapStreamMessage, data: bytes) -> Decision:
        decision = self.machine.receive_frame(frame_of(data))
        self.messages += 1
        assert decision.event == message
        if message.ttl == 0:  # memcached checks the TTL before the engine sees it
            self.nacks += 1
            assert decision.do is (Do.CLOSE if self.dialed else Do.NACK)
            assert answer(decision) == TapResponse(
                OPCODE_OF[type(message)], message.opaque, Status.INVALID_ARGUMENTS, b"TTL expired"
            )
            if self.dialed:
                assert decision.error is not None and decision.error.field == "ttl"
            return decision
        if message.tap_flags & TapFlags.ACK:
            assert answer(decision) == TapResponse(OPCODE_OF[type(message)], message.opaque)
        else:
            assert decision.reply == b""
        return decision

    @rule(message=stream_messages())
    def stream_message(self, message: TapStreamMessage) -> None:
        decision = self._stream(message, encode(message))
        if not message.ttl:
            return
        assert decision.do is Do.APPLY and decision.note is None
        self.machine.applied(message)
        # 3.0 src/tapconnection.cc processCheckpointCommand (an id over 0) and
        # VBucket::setState (active) end the backfill phase.
        if isinstance(message, TapCheckpointStart) and message.checkpoint_id:
            self.backfill.discard(message.vbucket)
        if isinstance(message, TapVbucketSet) and message.state == VBucketState.ACTIVE:
            self.backfill.discard(message.vbucket)

    @rule(
        code=st.sampled_from([*OpaqueCode, 5, 0xFFFF]),
        es_len=st.sampled_from([4, 4, 0, 2, 8, 0xFFFF]),
        vb=vbuckets,
        opaque=opaques,
        flags=tap_flags,
        ttl=ttls,
        short=st.booleans(),
    )
    def opaque(
        self, code: int, es_len: int, vb: int, opaque: int, flags: TapFlags, ttl: int, short: bool
    ) -> None:
        message = TapOpaque(code, vb, opaque, flags, ttl, es_len)
        data = encode(message)
        if short and es_len != 4:  # the TAP header alone: no code bytes either
            header = struct.pack(">HHB3x", es_len, flags, ttl)
            data = encode_frame(
                Magic.REQUEST, TapOpcode.OPAQUE, vbucket_or_status=vb, opaque=opaque, extras=header
            )
            message = TapOpaque(0, vb, opaque, flags, ttl, es_len)
        decision = self._stream(message, data)
        if not ttl:
            return
        if es_len == 4:
            assert decision.do is Do.APPLY and decision.note is None
            self.machine.applied(message)
            self.closing |= code == OpaqueCode.CLOSE_TAP_STREAM
            if code == OpaqueCode.INITIAL_VBUCKET_STREAM:
                self.backfill.add(vb)
            return
        # src/ep_engine.cc tapNotify: "Received tap opaque with unknown size": logged,
        # not applied, acked as processed.
        assert decision.do is Do.SKIP and decision.note is not None
        assert decision.note.level == "warning"
        for word in (PEER, "opcode=0x44", "field=engine_specific_length", f"value={es_len}"):
            assert word in decision.note.text

    @rule(vb=st.integers(0, 3), opaque=opaques, flags=tap_flags)
    def initial_vbucket_stream(self, vb: int, opaque: int, flags: TapFlags) -> None:
        self.opaque(OpaqueCode.INITIAL_VBUCKET_STREAM, 4, vb, opaque, flags, 255, False)

    @rule(
        vb=st.integers(0, 3),
        message=st.one_of(
            st.builds(TapCheckpointStart, st.sampled_from([0, 1, 7])),
            st.builds(TapVbucketSet, st.sampled_from(VBucketState)),
        ),
    )
    def phase_message(self, vb: int, message: TapCheckpointStart | TapVbucketSet) -> None:
        """What may end a backfill phase, on a vbucket that may be in one."""
        self.stream_message(replace(message, vbucket=vb))

    @rule(opaque=opaques)
    def noop(self, opaque: int) -> None:
        decision = self.machine.receive_frame(frame_of(encode(TapNoop(opaque))))
        assert decision.do is Do.ANSWER and answer(decision) == TapNoopResponse(opaque)

    @rule(opaque=opaques)
    def noop_response(self, opaque: int) -> None:
        decision = self.machine.receive_frame(frame_of(encode(TapNoopResponse(opaque))))
        assert decision.do is Do.IGNORE and decision.reply == b""

    @rule(opcode=st.sampled_from(sorted(OPCODE_OF.values())), status=st.integers(0, 0xFF))
    def response(self, opcode: TapOpcode, status: int) -> None:
        event = TapResponse(opcode, 7, status, b"text")
        decision = self.machine.receive_frame(frame_of(encode(event)))
        assert decision.reply == b""
        if self.dialed:  # its CONNECT refused, or an answer no producer sends
            assert decision.do is Do.CLOSE and decision.error is not None
            assert f"0x{status:02x}" in str(decision.error) and opcode.name in str(decision.error)
        else:
            assert decision.do is Do.IGNORE

    @rule(opaque=opaques)
    def connect(self, opaque: int) -> None:
        decision = self.machine.receive_frame(frame_of(encode(TapConnect(b"x", opaque=opaque))))
        assert decision.do is Do.CLOSE and decision.error is not None
        self._refused(decision, TapOpcode.CONNECT, opaque, Status.NOT_SUPPORTED)

    @rule(opaque=opaques)
    def malformed(self, opaque: int) -> None:
        # A DELETE shorter than its TAP header.
        data = encode_frame(Magic.REQUEST, TapOpcode.DELETE, opaque=opaque, extras=b"\0\0")
        decision = self.machine.receive_frame(frame_of(data))
        assert decision.do is Do.CLOSE and decision.event is None
        self._refused(decision, TapOpcode.DELETE, opaque, Status.INVALID_ARGUMENTS)

    def _refused(self, decision: Decision, opcode: int, opaque: int, status: int) -> None:
        if self.dialed:  # a refusal would read as a nack, acking what is not durable
            assert decision.reply == b""
            return
        reply = frame_of(decision.reply)
        assert (reply.magic, reply.opcode, reply.opaque) == (Magic.RESPONSE, opcode, opaque)
        assert reply.vbucket_or_status == status and reply.value

    @rule(opcode=st.sampled_from(UNKNOWN_OPCODES), opaque=opaques)
    def unknown_request(self, opcode: int, opaque: int) -> None:
        data = encode_frame(Magic.REQUEST, opcode, opaque=opaque, key=b"key", value=b"v")
        decision = self.machine.receive_frame(frame_of(data))
        self.unknown += 1
        assert decision.do is Do.ANSWER and decision.event is None
        reply = frame_of(decision.reply)
        assert (reply.magic, reply.opcode, reply.opaque) == (Magic.RESPONSE, opcode, opaque)
        assert reply.vbucket_or_status == Status.UNKNOWN_COMMAND and reply.body == b""
        if opcode in self.said:
            assert decision.note is None  # once per opcode
        else:
            self.said.add(opcode)
            assert decision.note is not None
            assert f"opcode=0x{opcode:02x}" in decision.note.text
            assert "field=opcode" in decision.note.text and PEER in decision.note.text

    @rule(opcode=st.sampled_from([o for o in UNKNOWN_OPCODES if o != Opcode.NOOP]))
    def unknown_response(self, opcode: int) -> None:
        data = encode_frame(Magic.RESPONSE, opcode, opaque=1)
        decision = self.machine.receive_frame(frame_of(data))
        assert decision.do is Do.CLOSE and decision.reply == b"" and decision.error is not None

    @invariant()
    def counts(self) -> None:
        if not hasattr(self, "machine"):
            return
        assert self.machine.messages == self.messages
        assert self.machine.nacks == self.nacks
        assert self.machine.unknown_requests == self.unknown
        assert self.machine.closing == self.closing
        assert self.machine.backfill == self.backfill


ConsumerModel.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_consumer_machine = ConsumerModel.TestCase


def test_a_nack_for_what_the_consumer_could_not_apply_is_counted() -> None:
    machine = TapConsumerMachine(PEER, dialed=False)
    message = TapMutation(b"k", b"v", 3, opaque=9)
    nack = machine.nack(message, Status.NOT_MY_VBUCKET, "dead vbucket")
    assert decode_frame(frame_of(nack)) == TapResponse(
        TapOpcode.MUTATION, 9, Status.NOT_MY_VBUCKET, b"dead vbucket"
    )
    assert machine.nacks == 1


def test_a_decoded_event_without_its_frame_is_decided_alike() -> None:
    machine = TapConsumerMachine(PEER, dialed=False)
    decision = machine.receive(TapConnect(b"x", opaque=5))
    assert decision.do is Do.CLOSE
    reply = frame_of(decision.reply)
    assert (reply.opcode, reply.opaque) == (TapOpcode.CONNECT, 5)
