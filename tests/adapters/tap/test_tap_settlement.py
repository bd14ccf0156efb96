"""What TAP acks settle: credit, replies and positions held on a batch's last message.

The ack rule is the producer's (``adapters/tap/producer.py``, after ep-engine
2.x tapconnection.cc ``TapProducer::processAck``: an ack of N releases N and
everything sent before it); these tests hold ``Settlements`` to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import Status
from adapters.tap import TapMutation, TapOpcode
from adapters.tap.producer import TapProducer
from adapters.tap.settlement import Settlements


@dataclass
class _Translator:
    last_seqno: int = 0


class _Stream:
    """A vbucket stream as a settlement sees it: a position and a last seqno."""

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.translator = _Translator()

    def position(self) -> tuple[int, int]:
        return (self.vbucket, self.translator.last_seqno)


def _ledger(*, support_ack: bool = True, registered: bool = True) -> Settlements[tuple[int, int]]:
    producer = TapProducer(support_ack=support_ack, ack_interval=1000, max_unacked=10_000)
    return Settlements(producer, support_ack=support_ack, registered=registered)


def _stamp(producer: TapProducer, count: int) -> None:
    for i in range(count):
        producer.stamp(TapMutation(b"k%d" % i, b"v"))


def _gather(
    ledger: Settlements[tuple[int, int]], stream: _Stream, credit: int, reply: bytes = b""
) -> None:
    settling = ledger.settling
    settling.credit += credit
    if reply:
        settling.replies.append(reply)
    stream.translator.last_seqno += 1
    settling.touched[stream.vbucket] = stream


def test_a_batch_settles_when_its_last_message_is_acked() -> None:
    ledger = _ledger(support_ack=True, registered=True)
    producer = ledger.producer
    stream = _Stream(3)
    _stamp(producer, 4)
    _gather(ledger, stream, 400, b"reply")
    ledger.end()
    assert ledger.take_ready() == []
    opaques = [3]
    assert ledger.acked(opaques) == [] and opaques == []  # not yet the last one
    (released,) = ledger.acked([4])
    assert (released.credit, released.replies, released.positions) == (
        400,
        [b"reply"],
        {3: (3, 1)},
    )
    assert ledger.oldest_arrival() == 0.0


def test_without_support_ack_a_batch_settles_at_once_with_seqnos() -> None:
    ledger = _ledger(support_ack=False, registered=False)
    producer = ledger.producer
    stream = _Stream(5)
    _stamp(producer, 2)
    _gather(ledger, stream, 100)
    ledger.end()
    (ready,) = ledger.take_ready()
    assert (ready.credit, ready.seqnos, ready.positions) == (100, {5: 1}, {})
    assert ledger.take_ready() == []


def test_an_older_upstream_is_owed_nothing_but_positions_still_settle() -> None:
    ledger = _ledger(support_ack=True, registered=True)
    producer = ledger.producer
    old = _Stream(1)
    _stamp(producer, 1)
    _gather(ledger, old, 50, b"old reply")
    ledger.end()
    ledger.new_upstream()  # the upstream was lost and dialed again
    new = _Stream(2)
    _stamp(producer, 1)
    _gather(ledger, new, 70)
    ledger.end()
    released = ledger.acked([2])
    assert [ledger.owed_upstream(s) for s in released] == [False, True]
    combined = ledger.combined(released)
    assert (combined.credit, combined.replies) == (70, [])
    assert combined.positions == {1: (1, 1), 2: (2, 1)}


def test_a_busy_nack_releases_nothing_and_a_refusal_is_fatal() -> None:
    ledger = _ledger(support_ack=True, registered=False)
    producer = ledger.producer
    _stamp(producer, 2)
    _gather(ledger, _Stream(0), 10)
    ledger.end()
    busy = ledger.answered(2, Status.BUSY, 0.0, b"", TapOpcode.MUTATION)
    # The message before the nacked one is acked (2.5.1 processAck's implicit
    # acks); the batch's settlement waits on the nacked one, sent again.
    assert busy == [] and producer.unacked == 1
    with pytest.raises(ProtocolError):
        ledger.answered(2, Status.INVALID_ARGUMENTS, 0.0, b"no", TapOpcode.MUTATION)


@settings(max_examples=200, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 1000), st.booleans()), max_size=30
    ),
    ack_points=st.lists(st.integers(0, 200), max_size=20),
)
def test_acks_release_exactly_the_batches_they_cover_in_order(
    batches: list[tuple[int, int, bool]], ack_points: list[int]
) -> None:
    """Whatever the batch sizes and however the peer acks (late, repeated, several
    per read), the credit released equals that of the batches whose last message
    was acked, each settlement is released once and oldest first, and an empty
    batch is never held."""
    ledger = _ledger(support_ack=True, registered=False)
    producer = ledger.producer
    stream = _Stream(0)
    ends: list[tuple[int, int]] = []  # (last sequence number, credit) per held batch
    sent = 0
    for size, credit, with_credit in batches:
        _stamp(producer, size)
        sent += size
        if with_credit:
            _gather(ledger, stream, credit + 1)
        ledger.end()
        ready = ledger.take_ready()
        if not (with_credit and sent):
            # Nothing gathered is never held; nothing stamped yet settles at once.
            assert len(ready) == (1 if with_credit else 0)
        else:
            assert ready == []
            if ends and ends[-1][0] == sent:
                ends[-1] = (sent, ends[-1][1] + credit + 1)  # merged with the held one
            else:
                ends.append((sent, credit + 1))
    acked = 0
    released_credit = 0
    for point in sorted(ack_points):
        if not sent:
            break
        opaque = min(point, sent) or 1
        released = ledger.acked([opaque, max(1, opaque - 1)])
        acked = max(acked, opaque)
        released_credit += sum(s.credit for s in released)
        expected = sum(c for last, c in ends if last <= acked)
        assert released_credit == expected
    held = sum(c for last, c in ends if last > acked)
    assert released_credit + held == sum(c for _, c in ends)


def test_last_acked_follows_the_acks() -> None:
    ledger = _ledger(support_ack=True, registered=True)
    producer = ledger.producer
    _stamp(producer, 5)
    assert ledger.last_acked == 0
    ledger.acked([2])
    assert ledger.last_acked == 2
    ledger.acked([1])  # late: covered already
    assert ledger.last_acked == 2
    ledger.answered(5, Status.SUCCESS, 0.0, b"", TapOpcode.MUTATION)
    assert ledger.last_acked == 5
