"""UPR flow control on both ends, including a property check that they agree."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from adapters.upr.flow_control import ConsumerAcker, ConsumerWindow, ProducerWindow, is_counted


def test_producer_stops_at_the_buffer_and_resumes_on_ack() -> None:
    window = ProducerWindow(100)
    window.sent(60)
    assert window.can_send and window.room == 40
    window.sent(60)  # a message may overshoot; the next one waits
    assert not window.can_send and window.room == 0
    window.acknowledged(30)
    assert window.can_send and window.unacked_bytes == 90


def test_over_acknowledgement_clamps_to_nothing_outstanding() -> None:
    """ep-engine 3.0 upr-producer.cc ``BufferLog::free``: more than was sent frees all."""
    window = ProducerWindow(100)
    window.sent(10)
    window.acknowledged(11)
    assert window.unacked_bytes == 0 and window.total_acked == 10 and window.can_send


def test_disabled_window_never_blocks() -> None:
    window = ProducerWindow()
    window.sent(10**9)
    assert window.can_send and window.room is None
    window.set_buffer_size(10)
    assert not window.can_send
    window.set_buffer_size(0)
    assert window.can_send


def test_consumer_acks_after_a_fifth_of_the_buffer_or_after_time() -> None:
    acker = ConsumerAcker(1000, seconds=5.0, now=0.0)
    assert acker.processed(150, now=1.0) == 0
    assert acker.processed(60, now=1.0) == 210
    assert acker.processed(10, now=2.0) == 0
    assert acker.due(4.0) == 0
    assert acker.due(6.1) == 10
    assert acker.due(20.0) == 0


def test_noops_and_responses_are_not_counted() -> None:
    assert is_counted("MUTATION", False)
    assert is_counted("SNAPSHOT_MARKER", False)
    assert not is_counted("NOOP", False)
    assert not is_counted("STREAM_REQ", True)


@given(st.integers(50, 5000), st.lists(st.integers(24, 400), min_size=1, max_size=300))
def test_producer_and_consumer_never_deadlock(buffer: int, sizes: list[int]) -> None:
    # Whatever the message sizes, a consumer that acks as ConsumerAcker says
    # (plus a timer flush when stalled) always lets the producer finish.
    window = ProducerWindow(buffer)
    acker = ConsumerAcker(buffer, seconds=1.0)
    now = 0.0
    pending = list(sizes)
    in_flight: list[int] = []
    while pending or in_flight:
        if pending and window.can_send:
            size = pending.pop(0)
            window.sent(size)
            in_flight.append(size)
            continue
        assert in_flight, "producer blocked with nothing in flight"
        size = in_flight.pop(0)
        ack = acker.processed(size, now)
        if ack:
            window.acknowledged(ack)
        elif not window.can_send and not in_flight:
            now += 1.0
            window.acknowledged(acker.due(now))
    assert window.total_sent == sum(sizes)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 500)), max_size=200))
def test_window_never_goes_below_zero_and_acks_never_exceed_sends(
    steps: list[tuple[bool, int]],
) -> None:
    window = ProducerWindow(300)
    for is_send, size in steps:
        if is_send:
            window.sent(size)
        else:
            window.acknowledged(size)
        assert 0 <= window.unacked_bytes == window.total_sent - window.total_acked


@given(
    buffer_size=st.integers(0, 10_000),
    steps=st.lists(st.tuples(st.booleans(), st.integers(-5, 5_000)), max_size=40),
)
def test_consumer_window_acknowledges_at_most_what_is_outstanding(
    buffer_size: int, steps: list[tuple[bool, int]]
) -> None:
    """ep-engine v3.0.0 src/upr-producer.cc ``BufferLog::free``: an ack frees what it
    names, up to what is outstanding; the consumer never names more, and sends
    nothing when nothing is freed or flow control is off."""
    window = ConsumerWindow(buffer_size)
    outstanding = 0
    for received, size in steps:
        if received:
            size = max(size, 0)
            window.unacked_bytes += size
            outstanding += size
            continue
        ack = window.release(size)
        expected = min(max(size, 0), outstanding) if buffer_size else 0
        assert ack == expected
        outstanding -= ack
        assert window.unacked_bytes == outstanding
        assert window.full == (0 < buffer_size <= outstanding)
