"""The sans-IO UPR producer stream (``adapters.upr.stream_machine``).

The rules follow ep-engine v3.0.0 src/upr-stream.cc (``ActiveStream``:
``transitionState``, ``takeoverSendPhase``, ``setVBucketStateAckRecieved``,
``snapshotMarkerAckReceived``) and src/upr-producer.cc (``closeStream``).
A stateful property test drives one stream with what its task and its
consumer may do, in any order, and checks each answer against a model.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from adapters import upr
from adapters.upr.constants import StreamState, VBucketState
from adapters.upr.stream_machine import _NEXT, StreamMachine, Wake, stats_rows

SF = upr.SnapshotFlags
S = StreamState
NO_FLAGS = upr.StreamFlags(0)


def request(flags: upr.StreamFlags = NO_FLAGS, end: int = 100) -> upr.StreamRequest:
    return upr.StreamRequest(
        vbucket=3, opaque=7, flags=flags, start_seqno=0, end_seqno=end,
        vbucket_uuid=0, snap_start_seqno=0, snap_end_seqno=0,
    )  # fmt: skip


def reply(command: upr.Command) -> upr.Response:
    return upr.Response(command, 7, 0)


def test_latest_and_disk_only_end_at_the_high_seqno() -> None:
    for flag in (upr.StreamFlags.LATEST, upr.StreamFlags.DISK_ONLY):
        assert StreamMachine(request(flag), 40, False).end_seqno == 40
    assert StreamMachine(request(), 40, False).end_seqno == 100


def test_a_takeover_marks_only_its_send_phase_markers_for_ack() -> None:
    rules = StreamMachine(request(upr.StreamFlags.TAKEOVER), 10, False, S.IN_MEMORY)
    assert rules.takeover and rules.ack_flag == SF(0)
    message, wait = rules.request_state(VBucketState.PENDING)
    assert wait and message.state is VBucketState.PENDING and rules.state is S.TAKEOVER_WAIT
    assert rules.ack_flag == SF(0)
    assert rules.receive(reply(upr.Command.SET_VBUCKET_STATE)) is Wake.STATE_REPLIED
    assert rules.receive(reply(upr.Command.SET_VBUCKET_STATE)) is None  # not awaited
    rules.state_confirmed()
    assert rules.ack_flag == SF.ACK
    rules.marker(1, 2, SF.MEMORY | rules.ack_flag)
    rules.marker(3, 3, SF.MEMORY | rules.ack_flag)
    assert rules.receive(reply(upr.Command.SNAPSHOT_MARKER)) is None
    assert rules.receive(reply(upr.Command.SNAPSHOT_MARKER)) is Wake.MARKERS_ACKED
    assert rules.receive(reply(upr.Command.SNAPSHOT_MARKER)) is None  # none outstanding


def test_the_draft_neither_acks_markers_nor_waits_for_replies() -> None:
    rules = StreamMachine(request(upr.StreamFlags.TAKEOVER), 10, True, S.IN_MEMORY)
    assert isinstance(rules.marker(1, 2, SF.MEMORY | SF.ACK), upr.SnapshotStart)
    assert rules.unacked_markers == 0
    assert isinstance(rules.snapshot_end(), upr.SnapshotEnd)
    _, wait = rules.request_state(VBucketState.PENDING)
    assert not wait and rules.awaiting is None
    rules.state_confirmed()
    assert rules.ack_flag == SF(0)


def test_close_stream_is_dead_at_once_and_sends_no_stream_end() -> None:
    rules = StreamMachine(request(), 10, False)
    assert rules.close_by_consumer()
    assert not rules.live
    assert not rules.close(upr.StreamEndReason.STATE_CHANGED)  # the first close wins
    assert rules.finish(upr.StreamEndReason.OK, cancelled=True) is None
    assert rules.end_reason is upr.StreamEndReason.CLOSED


def test_a_move_the_table_does_not_allow_is_refused() -> None:
    rules = StreamMachine(request(), 10, False, S.BACKFILLING)
    with pytest.raises(ValueError):
        rules.move(S.TAKEOVER_SEND)


def test_stats_rows_end_with_the_end_reason() -> None:
    rules = StreamMachine(request(), 10, False)
    assert stats_rows("c:", rules, [("opaque", 7)]) == [("c:stream_3_opaque", "7")]
    rules.finish(upr.StreamEndReason.OK, cancelled=False)
    assert stats_rows("", rules, [])[-1] == ("stream_3_end_reason", "ok")


class Stream(RuleBasedStateMachine):
    """One stream's task and its consumer, checked against a model of the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.rules: StreamMachine | None = None
        self.acks_owed = 0
        self.reply_owed = False
        self.closed_with: upr.StreamEndReason | None = None
        self.by_consumer = False
        self.finished = False

    @rule(draft=st.booleans(), takeover=st.booleans())
    @precondition(lambda self: self.rules is None)
    def start(self, draft: bool, takeover: bool) -> None:
        flags = upr.StreamFlags.TAKEOVER if takeover else upr.StreamFlags(0)
        self.rules = StreamMachine(request(flags), 50, draft)

    def _rules(self) -> StreamMachine:
        assert self.rules is not None
        return self.rules

    @rule(to=st.sampled_from(list(StreamState)))
    @precondition(lambda self: self.rules is not None)
    def move(self, to: StreamState) -> None:
        rules = self._rules()
        before = rules.state
        if before is not S.DEAD and to not in _NEXT[before]:
            with pytest.raises(ValueError):
                rules.move(to)
            assert rules.state is before
            return
        rules.move(to)
        assert rules.state is (S.DEAD if before is S.DEAD else to)

    @rule(ack=st.booleans())
    @precondition(lambda self: self.rules is not None)
    def marker(self, ack: bool) -> None:
        rules = self._rules()
        flags = SF.MEMORY | (rules.ack_flag if ack else SF(0))
        message = rules.marker(1, 2, flags)
        if rules.draft:
            assert isinstance(message, upr.SnapshotStart)
            assert rules.snapshot_end() is not None
            return
        assert isinstance(message, upr.SnapshotMarker) and message.flags == flags
        assert rules.snapshot_end() is None
        if flags & SF.ACK:
            assert rules.state is S.TAKEOVER_SEND
            self.acks_owed += 1

    @rule(state=st.sampled_from([VBucketState.PENDING, VBucketState.ACTIVE]))
    @precondition(
        lambda self: self.rules is not None and self.rules.state in (S.IN_MEMORY, S.TAKEOVER_SEND)
    )
    def request_state(self, state: VBucketState) -> None:
        rules = self._rules()
        message, wait = rules.request_state(state)
        assert message.state is state and wait is not rules.draft
        assert rules.state is S.TAKEOVER_WAIT
        self.reply_owed = wait

    @rule()
    @precondition(
        lambda self: (
            self.rules is not None and self.rules.state is S.TAKEOVER_WAIT and not self.reply_owed
        )
    )
    def confirmed(self) -> None:
        self._rules().state_confirmed()
        assert self._rules().state is S.TAKEOVER_SEND

    @rule(command=st.sampled_from(list(upr.Command)))
    @precondition(lambda self: self.rules is not None)
    def response(self, command: upr.Command) -> None:
        wake = self._rules().receive(reply(command))
        if command is upr.Command.SET_VBUCKET_STATE:
            assert wake is (Wake.STATE_REPLIED if self.reply_owed else None)
            self.reply_owed = False
        elif command is upr.Command.SNAPSHOT_MARKER:
            assert wake is (Wake.MARKERS_ACKED if self.acks_owed == 1 else None)
            self.acks_owed = max(0, self.acks_owed - 1)
        else:
            assert wake is None

    @rule(reason=st.sampled_from(list(upr.StreamEndReason)), by_consumer=st.booleans())
    @precondition(lambda self: self.rules is not None and not self.finished)
    def close(self, reason: upr.StreamEndReason, by_consumer: bool) -> None:
        rules = self._rules()
        first = self.closed_with is None
        if by_consumer:
            assert rules.close_by_consumer() is first
            if first:
                self.closed_with, self.by_consumer = upr.StreamEndReason.CLOSED, True
        else:
            assert rules.close(reason) is first
            if first:
                self.closed_with = reason
        if self.by_consumer:
            assert not rules.live

    @rule(reason=st.sampled_from(list(upr.StreamEndReason)), cancelled=st.booleans())
    @precondition(lambda self: self.rules is not None and not self.finished)
    def finish(self, reason: upr.StreamEndReason, cancelled: bool) -> None:
        rules = self._rules()
        end = rules.finish(reason, cancelled)
        expected = self.closed_with if cancelled and self.closed_with is not None else reason
        assert rules.end_reason is expected and not rules.live
        if self.by_consumer:
            assert end is None
        else:
            assert end is not None and end.reason is expected and end.opaque == 7
        self.finished = True

    @invariant()
    def counts_agree(self) -> None:
        if self.rules is not None:
            assert self.rules.unacked_markers == self.acks_owed
            assert (self.rules.awaiting is not None) == self.reply_owed


Stream.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestStream = Stream.TestCase
