"""The node's consumer connection machine, against a model of its rules.

The rules follow ep-engine 3.0 src/upr-consumer.cc (``addStream``,
``handleResponse``) and src/upr-stream.cc (``PassiveStream::processMarker``,
``handleSnapshotEnd``, ``processSetVBucketState``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import FrameReader, Status
from adapters.mcbp.constants import VBucketState
from adapters.upr.consumer_machine import MAX_ROLLBACKS, ConsumerMachine, Item, Note
from adapters.upr.producer_machine import Reply

SF = upr.SnapshotFlags
RECEIVING = {0: VBucketState.REPLICA, 1: VBucketState.REPLICA, 2: VBucketState.PENDING}
VBUCKETS = [0, 1, 2, 3, 4]
"""3 is ACTIVE and 4 is not here: neither receives."""


@dataclass
class FakeReplica:
    """Vbuckets as the machine sees them: positions, states and what was written."""

    high: dict[int, int] = field(default_factory=lambda: dict.fromkeys(VBUCKETS, 0))
    snap: dict[int, tuple[int, int]] = field(default_factory=dict)
    states: dict[int, VBucketState] = field(default_factory=lambda: dict(RECEIVING))
    logs: dict[int, object] = field(default_factory=dict)
    applied: list[Item] = field(default_factory=list)
    refuse_items: bool = False

    def receives(self, vbucket: int) -> bool:
        return self.states.get(vbucket, VBucketState.ACTIVE) not in (
            VBucketState.ACTIVE,
            VBucketState.DEAD,
        )

    def high_seqno(self, vbucket: int) -> int:
        return self.high[vbucket]

    def snapshot(self, vbucket: int) -> tuple[int, int]:
        return self.snap.get(vbucket, (0, 0))

    def set_snapshot(self, vbucket: int, start: int, end: int) -> None:
        self.snap[vbucket] = (start, end)

    def uuid(self, vbucket: int) -> int:
        return 0xAB00 + vbucket

    def replace_failover_log(self, vbucket: int, entries: object) -> None:
        self.logs[vbucket] = entries

    def rollback(self, vbucket: int, seqno: int) -> int:
        self.high[vbucket] = min(self.high[vbucket], seqno)
        return self.high[vbucket]

    def apply(self, item: Item, now: float) -> None:
        if self.refuse_items:
            raise ProtocolError("refused")
        self.applied.append(item)
        self.high[item.vbucket] = item.by_seqno

    def set_state(self, vbucket: int, state: VBucketState, now: float) -> None:
        self.states[vbucket] = state


def sent(outputs: tuple[object, ...]) -> list[upr.UprEvent]:
    reader = FrameReader()
    for output in outputs:
        assert isinstance(output, Reply | Note)
        if isinstance(output, Reply):
            reader.receive_data(output.data)
    return [upr.decode_frame(frame, upr.DCP) for frame in reader.frames()]


def test_a_refused_item_raises_and_is_not_counted() -> None:
    replica = FakeReplica(refuse_items=True)
    machine = ConsumerMachine(upr.DCP, replica, set())
    _, request = sent(machine.receive(upr.AddStream(opaque=9, vbucket=1), 0.0))
    assert isinstance(request, upr.StreamRequest)
    machine.receive(upr.StreamRequestOk((), request.opaque), 0.0)
    item = upr.Mutation(b"k", b"v", by_seqno=1, opaque=request.opaque, vbucket=1)
    with pytest.raises(ProtocolError):  # the replica's refusal closes the connection
        machine.receive(item, 0.0)
    assert machine.items_received == 0


def test_a_stream_that_keeps_rolling_back_is_given_up() -> None:
    machine = ConsumerMachine(upr.DCP, FakeReplica(), set())
    _, request = sent(machine.receive(upr.AddStream(opaque=9, vbucket=1), 0.0))
    for _ in range(MAX_ROLLBACKS):
        (request,) = sent(machine.receive(upr.StreamRequestRollback(0, request.opaque), 0.0))
        assert isinstance(request, upr.StreamRequest)
    assert sent(machine.receive(upr.StreamRequestRollback(0, request.opaque), 0.0)) == []
    assert machine.streams[1].state == "dead" and machine.streams[1].rollbacks == MAX_ROLLBACKS + 1


def test_requests_a_consumer_does_not_take_are_not_supported_and_flush_is_dropped() -> None:
    machine = ConsumerMachine(upr.DCP, FakeReplica(), set())
    (answer,) = sent(machine.receive(upr.GetFailoverLog(opaque=5, vbucket=1), 0.0))
    assert isinstance(answer, upr.Response) and answer.status == Status.NOT_SUPPORTED
    assert machine.receive(upr.Flush(opaque=6, vbucket=1), 0.0) == ()


@dataclass
class Model:
    opaque: int
    state: str = "pending"
    ack_due: bool = False
    snap_end: int = 0
    rollbacks: int = 0


class Consumer(RuleBasedStateMachine):
    """A producer (and orchestrator) talking to one consumer connection."""

    def __init__(self) -> None:
        super().__init__()
        self.replica = FakeReplica()
        self.backfill: set[int] = set()
        self.machine = ConsumerMachine(upr.DCP, self.replica, self.backfill)
        self.model: dict[int, Model] = {}
        self.expect_backfill: set[int] = set()
        self.items = 0

    def _send(self, event: upr.UprEvent) -> list[upr.UprEvent]:
        return sent(self.machine.receive(event, 0.0))

    def _check_request(self, request: upr.UprEvent, vb: int) -> None:
        assert isinstance(request, upr.StreamRequest) and request.vbucket == vb
        high = self.replica.high[vb]
        assert request.start_seqno == high and request.vbucket_uuid == 0xAB00 + vb
        assert request.snap_start_seqno <= high <= request.snap_end_seqno

    def _in(self, state: str) -> list[int]:
        return [vb for vb, m in self.model.items() if m.state == state]

    @initialize(accepted=st.sets(st.sampled_from(sorted(RECEIVING))))
    def open_streams(self, accepted: set[int]) -> None:
        """Streams for some vbuckets from the start, so that the steps reach them."""
        for vb in sorted(accepted):
            self.add_stream(vb, 100 + vb)
            assert self._send(upr.StreamRequestOk((), self.model[vb].opaque)) == []
            self.model[vb].state = "reading"

    @rule(vb=st.sampled_from(VBUCKETS), opaque=st.integers(0, 2**32 - 1))
    def add_stream(self, vb: int, opaque: int) -> None:
        out = self._send(upr.AddStream(opaque=opaque, vbucket=vb))
        answer = out[0]
        assert isinstance(answer, upr.AddStreamResponse) and answer.opaque == opaque
        live = vb in self.model and self.model[vb].state != "dead"
        if not self.replica.receives(vb):
            assert answer.status == Status.NOT_MY_VBUCKET and len(out) == 1
        elif live:
            assert answer.status == Status.KEY_EXISTS and len(out) == 1
        else:
            assert answer.status == 0 and len(out) == 2
            self._check_request(out[1], vb)
            assert out[1].opaque == answer.stream_opaque
            assert all(m.opaque != answer.stream_opaque for m in self.model.values())
            self.model[vb] = Model(answer.stream_opaque)

    @precondition(lambda self: self._in("pending"))
    @rule(data=st.data(), how=st.sampled_from(["ok", "rollback", "refused"]))
    def answer(self, data: st.DataObject, how: str) -> None:
        vb = data.draw(st.sampled_from(self._in("pending")))
        m = self.model[vb]
        if how == "ok":
            assert self._send(upr.StreamRequestOk(((7, 0),), m.opaque)) == []
            m.state = "reading"
            assert self.replica.logs[vb] == ((7, 0),)
        elif how == "rollback":
            seqno = data.draw(st.integers(0, self.replica.high[vb]))
            out = self._send(upr.StreamRequestRollback(seqno, m.opaque))
            m.rollbacks += 1
            if m.rollbacks > MAX_ROLLBACKS:
                assert out == []
                m.state = "dead"
            else:
                assert self.replica.high[vb] == seqno and len(out) == 1
                self._check_request(out[0], vb)
        else:
            status = Status.NOT_MY_VBUCKET.value
            assert self._send(upr.Response(upr.Command.STREAM_REQ, m.opaque, status)) == []
            m.state = "dead"

    def _acks(self, out: list[upr.UprEvent], m: Model) -> tuple[list[upr.UprEvent], int]:
        """``out`` without the marker acks, and how many there were."""
        rest, acks = [], 0
        for event in out:
            if isinstance(event, upr.Response) and event.command is upr.Command.SNAPSHOT_MARKER:
                assert event.opaque == m.opaque and event.status == 0
                acks += 1
            else:
                rest.append(event)
        return rest, acks

    @precondition(lambda self: self._in("reading"))
    @rule(data=st.data(), disk=st.booleans(), ack=st.booleans(), span=st.integers(0, 3))
    def marker(self, data: st.DataObject, disk: bool, ack: bool, span: int) -> None:
        vb = data.draw(st.sampled_from(self._in("reading")))
        m = self.model[vb]
        high = self.replica.high[vb]
        flags = (SF.DISK if disk else SF.MEMORY) | (SF.ACK if ack else SF(0))
        out = self._send(upr.SnapshotMarker(high + 1, high + span, flags, m.opaque, vb))
        # The last marker's ack if still owed, then this one's if its end is applied.
        assert self._acks(out, m) == ([], int(m.ack_due) + int(ack and span == 0))
        m.ack_due = ack and span > 0
        m.snap_end = high + span
        if disk and high == 0:
            self.expect_backfill.add(vb)
        else:
            self.expect_backfill.discard(vb)
        assert self.replica.snap[vb] == (high + 1, high + span)

    @precondition(lambda self: self._in("reading"))
    @rule(data=st.data(), kind=st.sampled_from([upr.Mutation, upr.Deletion, upr.Expiration]))
    def item(self, data: st.DataObject, kind: type[Item]) -> None:
        vb = data.draw(st.sampled_from(self._in("reading")))
        m = self.model[vb]
        seqno = self.replica.high[vb] + 1
        out = self._send(kind(b"k", by_seqno=seqno, opaque=m.opaque, vbucket=vb))  # type: ignore[call-arg]
        self.items += 1
        owed = m.ack_due and seqno >= m.snap_end
        assert self._acks(out, m) == ([], int(owed))
        m.ack_due = m.ack_due and not owed
        if seqno >= m.snap_end:  # the snapshot's end applied ends a backfill
            self.expect_backfill.discard(vb)
        assert self.replica.applied[-1].by_seqno == seqno

    @rule(vb=st.sampled_from(VBUCKETS), opaque=st.integers(0, 50))
    def stray_item(self, vb: int, opaque: int) -> None:
        reading = [m.opaque for v, m in self.model.items() if m.state == "reading" and v == vb]
        if opaque in reading:
            return
        before = len(self.replica.applied)
        out = self.machine.receive(upr.Mutation(b"s", by_seqno=99, opaque=opaque, vbucket=vb), 0.0)
        assert all(isinstance(o, Note) for o in out)
        assert len(self.replica.applied) == before

    @precondition(lambda self: self._in("reading"))
    @rule(data=st.data(), state=st.sampled_from(list(VBucketState)))
    def set_vbucket_state(self, data: st.DataObject, state: VBucketState) -> None:
        vb = data.draw(st.sampled_from(self._in("reading")))
        m = self.model[vb]
        out = self._send(upr.SetVbucketState(state, m.opaque, vb))
        (answer,), acks = self._acks(out, m)
        assert acks == int(m.ack_due)
        m.ack_due = False
        assert isinstance(answer, upr.Response) and answer.status == 0
        assert self.replica.states[vb] is state
        if state is VBucketState.ACTIVE:
            self.expect_backfill.discard(vb)

    @rule(vb=st.sampled_from(VBUCKETS), opaque=st.integers(0, 50))
    def stray_vbucket_state(self, vb: int, opaque: int) -> None:
        m = self.model.get(vb)
        if m is not None and m.state == "reading" and m.opaque == opaque:
            return
        (answer,) = self._send(upr.SetVbucketState(VBucketState.ACTIVE, opaque, vb))
        assert isinstance(answer, upr.Response) and answer.status == Status.KEY_NOT_FOUND

    @precondition(lambda self: self.model)
    @rule(data=st.data(), close=st.booleans())
    def end(self, data: st.DataObject, close: bool) -> None:
        vb = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[vb]
        if close:
            (answer,) = self._send(upr.CloseStream(opaque=3, vbucket=vb))
            assert isinstance(answer, upr.Response)
            assert answer.status == (Status.KEY_NOT_FOUND if m.state == "dead" else 0)
        else:
            assert self._send(upr.StreamEnd(upr.StreamEndReason.OK, m.opaque, vb)) == []
        m.state = "dead"

    @rule(opaque=st.integers(0, 2**32 - 1))
    def noop(self, opaque: int) -> None:
        (answer,) = self._send(upr.Noop(opaque=opaque))
        assert isinstance(answer, upr.Response) and answer.opaque == opaque

    @invariant()
    def agrees_with_the_model(self) -> None:
        states = {vb: s.state for vb, s in self.machine.streams.items()}
        assert states == {vb: m.state for vb, m in self.model.items()}
        assert self.backfill == self.expect_backfill
        assert self.machine.items_received == self.items == len(self.replica.applied)


Consumer.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestConsumer = Consumer.TestCase
