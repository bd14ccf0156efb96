"""The sans-IO UPR producer connection (``adapters.upr.producer_machine``).

The rules follow ep-engine v3.0.0 src/upr-producer.cc (``control``,
``bufferAcknowledgement``, ``closeStream``, ``streamRequest``,
``maybeSendNoop``) and memcached v3.0.0 daemon/memcached.c
(``conn_ship_log``: commands that are not UPR's are dispatched as on any
connection). A stateful property test drives the machine with what a
consumer may send, in any order, and checks each answer against a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, FrameReader, Magic, Status, encode_frame
from adapters.upr import producer_machine as pm
from adapters.upr.events import REQUEST_CLASSES
from adapters.upr.flow_control import COUNTED_CLASSES, is_counted
from adapters.upr.producer_machine import ProducerMachine

VBUCKETS = 4
SERVED = frozenset({0, 1, 2})
"""vbucket 3 is not served: NOT_MY_VBUCKET."""


@dataclass
class FakeStream:
    opaque: int
    live: bool = True


def replies(outputs: tuple[pm.Output, ...]) -> list[Frame]:
    reader = FrameReader()
    for output in outputs:
        if isinstance(output, pm.Reply):
            reader.receive_data(output.data)
    return list(reader.frames())


def machine(**options: object) -> ProducerMachine[FakeStream]:
    return ProducerMachine(
        "consumer",
        upr.DCP,
        noop_interval=10.0,
        serves=SERVED.__contains__,
        **options,  # type: ignore[arg-type]
    )


def test_counted_messages_are_the_same_by_class_and_by_name() -> None:
    for cls in REQUEST_CLASSES.values():
        assert (cls in COUNTED_CLASSES) == is_counted(cls.NAME, False), cls


def test_a_request_that_is_not_upr_goes_to_the_command_door() -> None:
    """memcached v3.0.0 daemon/memcached.c ``conn_ship_log``/``process_bin_packet``."""
    m = machine()
    for opcode in (0x0A, 0x0B, 0x10, 0xEE):
        frame = _frame(encode_frame(Magic.REQUEST, opcode, opaque=9))
        assert m.receive_frame(frame, 0.0) == (pm.McCommand(frame),)


def test_a_malformed_request_is_answered_then_fails() -> None:
    m = machine()
    frame = _frame(encode_frame(Magic.REQUEST, 0x53, opaque=4))  # STREAM_REQ without extras
    reply, fail = m.receive_frame(frame, 0.0)
    assert isinstance(fail, pm.Fail)
    (answer,) = replies((reply,))
    assert (answer.opcode, answer.opaque) == (0x53, 4)
    assert answer.vbucket_or_status == Status.INVALID_ARGUMENTS


def test_takeover_without_admin_is_no_access() -> None:
    m = machine(admission=lambda what: f"{what} needs an admin")
    req = upr.StreamRequest(vbucket=1, opaque=5, flags=upr.StreamFlags.TAKEOVER)
    (answer,) = replies(m.receive(req, 0.0))
    assert answer.vbucket_or_status == Status.NO_ACCESS and b"needs an admin" in answer.value


def _frame(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


@given(st.binary(max_size=24), st.binary(max_size=12))
def test_every_control_gets_one_answer_and_never_closes(key: bytes, value: bytes) -> None:
    """upr-producer.cc ``control``: OK, NOT_SUPPORTED or EINVAL, the connection stays."""
    m = machine()
    outputs = m.receive(upr.Control(key=key, value=value, opaque=3), 0.0)
    (answer,) = replies(outputs)
    assert answer.opaque == 3
    assert answer.vbucket_or_status in (0, Status.NOT_SUPPORTED, Status.INVALID_ARGUMENTS)
    assert not [o for o in outputs if isinstance(o, pm.Fail)]
    applied = [o for o in outputs if isinstance(o, pm.Applied)]
    assert bool(applied) == (answer.vbucket_or_status == 0)


class Connection(RuleBasedStateMachine):
    """A consumer's requests in any order, against a model of what each must do."""

    def __init__(self) -> None:
        super().__init__()
        self.m = machine(delete_times=True)
        self.now = 0.0
        self.live: dict[int, FakeStream] = {}
        self.opaques = iter(range(100, 10**9))
        self.noop_sent: int | None = None
        self.closed = False

    def step(self, event: upr.UprEvent) -> tuple[pm.Output, ...]:
        self.now += 0.5
        return self.m.receive(event, self.now)

    @rule(vb=st.integers(0, VBUCKETS - 1), takeover=st.booleans())
    def stream_request(self, vb: int, takeover: bool) -> None:
        opaque = next(self.opaques)
        flags = upr.StreamFlags.TAKEOVER if takeover else upr.StreamFlags(0)
        outputs = self.step(upr.StreamRequest(vbucket=vb, opaque=opaque, flags=flags))
        if vb not in SERVED:
            assert [r.vbucket_or_status for r in replies(outputs)] == [Status.NOT_MY_VBUCKET]
        elif vb in self.live:
            assert [r.vbucket_or_status for r in replies(outputs)] == [Status.KEY_EXISTS]
        else:
            assert outputs == (pm.StreamWanted(outputs[0].request),)  # type: ignore[union-attr]
            stream = FakeStream(opaque)
            self.m.add_stream(vb, stream)
            self.live[vb] = stream

    @rule(vb=st.integers(0, VBUCKETS - 1))
    def close_stream(self, vb: int) -> None:
        outputs = self.step(upr.CloseStream(vbucket=vb, opaque=7))
        answers = replies(outputs)
        assert [(r.opaque, r.opcode) for r in answers] == [(7, 0x52)]
        stream = self.live.pop(vb, None)
        if stream is None:
            assert answers[0].vbucket_or_status == Status.KEY_NOT_FOUND
        else:
            assert outputs[0] == pm.EndStream(stream) and answers[0].vbucket_or_status == 0
            stream.live = False  # what the I/O side does before it sends the answer

    @rule(vb=st.integers(0, VBUCKETS - 1))
    def stream_ends(self, vb: int) -> None:
        stream = self.live.pop(vb, None)
        if stream is not None:
            stream.live = False

    @rule(size=st.integers(0, 5000))
    def buffer_size(self, size: int) -> None:
        outputs = self.step(upr.Control(b"connection_buffer_size", b"%d" % size, opaque=8))
        assert [r.vbucket_or_status for r in replies(outputs)] == [0]
        assert pm.Room() in outputs
        assert self.m.window.enabled == (size > 0)

    @rule(size=st.integers(1, 3000))
    def stream_sends(self, size: int) -> None:
        window = self.m.window
        if window.enabled and window.can_send:
            window.sent(size)

    @rule(size=st.integers(0, 6000))
    def buffer_ack(self, size: int) -> None:
        before = self.m.window.unacked_bytes
        outputs = self.step(upr.BufferAcknowledgement(buffer_bytes=size, opaque=0))
        assert not replies(outputs)  # never answered
        if self.m.window.enabled:
            assert outputs == (pm.Room(),)
            assert self.m.window.unacked_bytes == max(0, before - size)

    @rule(on=st.booleans(), interval=st.sampled_from([b"1", b"2.5", b"0", b"x"]))
    def noop_settings(self, on: bool, interval: bytes) -> None:
        self.step(upr.Control(b"set_noop_interval", interval, opaque=9))
        outputs = self.step(upr.Control(b"enable_noop", b"true" if on else b"no", opaque=9))
        assert [r.vbucket_or_status for r in replies(outputs)] == [0]
        assert (self.m.next_deadline() is not None) == on
        if on:
            assert self.m.next_deadline() == self.now + self.m.noop_interval

    @precondition(lambda self: not self.closed)
    @rule(early=st.booleans())
    def timer(self, early: bool) -> None:
        deadline = self.m.next_deadline()
        if deadline is None:
            assert self.m.on_timer(self.now) == b""
            return
        if early:
            assert self.m.on_timer(deadline - 0.01) == b""
            return
        self.now = max(self.now, deadline)
        if self.noop_sent is not None:
            with pytest.raises(ProtocolError):
                self.m.on_timer(self.now)
            self.closed = True
            return
        (noop,) = replies((pm.Reply(self.m.on_timer(self.now)),))
        assert noop.magic == Magic.REQUEST and noop.opcode == 0x5C
        self.noop_sent = noop.opaque
        assert self.m.next_deadline() == self.now + self.m.noop_interval

    @precondition(lambda self: self.noop_sent is not None)
    @rule()
    def noop_answered(self) -> None:
        response = upr.Response(upr.Command.NOOP, self.noop_sent or 0, 0)
        assert self.step(response) == ()
        self.noop_sent = None

    @rule(vb=st.integers(0, VBUCKETS - 1))
    def state_reply(self, vb: int) -> None:
        stream = self.live.get(vb)
        opaque = stream.opaque if stream is not None else 1
        response = upr.Response(upr.Command.SET_VBUCKET_STATE, opaque, 0)
        outputs = self.step(response)
        assert outputs == ((pm.Deliver(stream, response),) if stream is not None else ())

    @invariant()
    def window_is_consistent(self) -> None:
        window = self.m.window
        assert 0 <= window.unacked_bytes <= window.total_sent
        assert window.total_acked + window.unacked_bytes == window.total_sent


Connection.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_connection = Connection.TestCase
