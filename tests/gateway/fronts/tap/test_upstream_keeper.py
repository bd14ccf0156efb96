"""The TAP front's upstream keeper: NOOPs answered while the pump is away, each once,
and the pump handed every byte the keeper read, with one socket read at a time.

A 3.0 producer drops a connection whose NOOP is unanswered at the next interval
(ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::maybeSendNoop``); it sends
NOOPs between any other messages, uncounted by its flow control
(``BufferLog::insert``).
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import FrameReader
from gateway.fronts.tap.upstream import UprUpstream
from gateway.io.connection import PacketConnection
from tests.support.raw_dcp import HEADER, MUTATION, NOOP, RES, frame
from tests.support.scripted_upr import marker, mutation, noop
from tests.support.waiting import until


def _upstream(stream: trio.abc.Stream) -> UprUpstream:
    upstream = UprUpstream(PacketConnection(stream), "upstream", upr.DCP)
    upstream.window.buffer_size = 64 * 1024  # flow control and NOOPs negotiated
    return upstream


async def test_the_pump_gets_what_the_keeper_read_before_reading_again() -> None:
    gateway_end, producer_end = trio.testing.memory_stream_pair()
    upstream = _upstream(gateway_end)
    sent = [mutation(1, n, b"k%d" % n) for n in range(1, 4)] + [noop(7)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(upstream.keep_alive)
        with upstream.pump_away():
            await producer_end.send_all(b"".join(sent))
            await until(lambda: upstream.noops_kept == 1)
            # The keeper reads on, for bytes that do not come.
            await trio.testing.wait_all_tasks_blocked()
        reply = await producer_end.receive_some()
        assert HEADER.unpack_from(reply)[:2] == (RES, NOOP)
        assert HEADER.unpack_from(reply)[7] == 7

        received: list[bool] = []

        async def pump() -> None:
            await upstream.receive()
            received.append(True)

        # Back from its wait, the pump is handed what the keeper read at once ...
        nursery.start_soon(pump)
        await trio.testing.wait_all_tasks_blocked()
        assert received == [True]
        frames = upstream.reader.frames()
        assert [f.opcode for f in frames] == [MUTATION] * 3 + [NOOP]
        assert upstream.answered(frames[-1])  # the pump does not answer it again
        # ... and next takes over the keeper's read (a second read of the stream
        # at once would raise BusyResourceError).
        nursery.start_soon(pump)
        await trio.testing.wait_all_tasks_blocked()
        assert received == [True]
        await producer_end.send_all(mutation(1, 4, b"k4"))
        await until(lambda: len(received) == 2)
        assert [f.opcode for f in upstream.reader.frames()] == [MUTATION]
        nursery.cancel_scope.cancel()


async def test_a_connection_closed_while_the_pump_is_away_is_raised_after_its_bytes() -> None:
    gateway_end, producer_end = trio.testing.memory_stream_pair()
    upstream = _upstream(gateway_end)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(upstream.keep_alive)
        with upstream.pump_away():
            await producer_end.send_all(mutation(1, 1, b"k"))
            await producer_end.aclose()
            await trio.testing.wait_all_tasks_blocked()
        await upstream.receive()  # the item first
        assert [f.opcode for f in upstream.reader.frames()] == [MUTATION]
        try:
            await upstream.receive()
        except Exception as exc:
            assert "closed the connection" in str(exc)
        else:
            raise AssertionError("the close was not raised")
        nursery.cancel_scope.cancel()


class _Unconnected:
    """What the sync part of the keeper uses of a connection: its reader."""

    def __init__(self) -> None:
        self.reader = FrameReader()


_FRAMES = st.one_of(
    st.builds(
        lambda n, size: mutation(1, n, b"k", b"v" * size), st.integers(1, 99), st.integers(0, 300)
    ),
    st.builds(noop, st.integers(0, 0xFFFFFFFF)),
    st.builds(lambda n: marker(1, n, n + 5, 1), st.integers(0, 99)),
    st.builds(lambda o: frame(NOOP, magic=RES, opaque=o), st.integers(0, 99)),  # not a request
)


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(_FRAMES, max_size=30),
    cuts=st.lists(st.integers(1, 400), max_size=40),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 4)), max_size=40),
)
def test_every_noop_is_answered_once_in_order(
    frames: list[bytes], cuts: list[int], steps: list[tuple[bool, int]]
) -> None:
    """However the bytes arrive and whoever looks first (the keeper scanning, the
    pump taking frames), each NOOP request is answered once, in stream order."""
    upstream = UprUpstream(_Unconnected(), "upstream", upr.DCP)  # type: ignore[arg-type]
    reader = upstream.reader
    data = b"".join(frames)
    answered: list[int] = []

    def pump(count: int) -> None:
        for _ in range(count):
            got = reader.next_frame()
            if got is None:
                return
            if got.magic == 0x80 and got.opcode == NOOP and not upstream.answered(got):
                answered.append(got.opaque)

    at = 0
    for index, step in enumerate([*steps, (False, 1 << 20)]):
        cut = cuts[index] if index < len(cuts) else len(data)
        if at < len(data):
            reader.receive_data(data[at : at + cut])
            at += cut
        keeper, count = step
        if keeper:
            answered += upstream.take_buffered_noops()
        pump(count)
    while at < len(data):
        reader.receive_data(data[at : at + 4096])
        at += 4096
    pump(1 << 20)
    expected = [HEADER.unpack_from(f)[7] for f in frames if f[:2] == bytes((0x80, NOOP))]
    assert answered == expected
