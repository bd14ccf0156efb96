"""Direct writes: with nothing queued and the writer idle, the sender writes the socket.

Over real loopback sockets (only a ``trio.SocketStream`` takes direct writes),
with small kernel buffers so writes are partial and the writer takes over.
"""

from __future__ import annotations

import socket
import struct

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.io.connection import PacketConnection

SMALL_BUFFER = 4096
CHUNK_HEADER = struct.Struct(">III")  # sender, sequence number, payload length


async def tcp_pair(small: bool = True) -> tuple[trio.SocketStream, trio.SocketStream]:
    """A connected loopback pair (sender, peer); ``small`` shrinks both kernel buffers."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    if small:
        listener.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    port = listener.socket.getsockname()[1]
    sender = await trio.open_tcp_stream("127.0.0.1", port)
    peer = await listener.accept()
    await listener.aclose()
    if small:
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    return sender, peer


def chunk(sender: int, seq: int, size: int) -> bytes:
    return CHUNK_HEADER.pack(sender, seq, size) + bytes([(sender + seq) % 256]) * size


def check_stream(data: bytes, senders: int) -> list[int]:
    """Parse ``data`` as whole chunks; every sender's must come in order, unbroken."""
    seen = [0] * senders
    offset = 0
    while offset < len(data):
        sender, seq, size = CHUNK_HEADER.unpack_from(data, offset)
        assert seq == seen[sender], (sender, seq, seen[sender])
        start = offset + CHUNK_HEADER.size
        assert data[start : start + size] == bytes([(sender + seq) % 256]) * size
        seen[sender] += 1
        offset = start + size
    return seen


async def receive_exactly(peer: trio.SocketStream, total: int) -> bytes:
    received = bytearray()
    while len(received) < total:
        data = await peer.receive_some(65536)
        assert data, "peer closed early"
        received += data
    return bytes(received)


async def test_an_idle_writer_lets_the_sender_write_at_once() -> None:
    sender, peer = await tcp_pair(small=False)
    conn = PacketConnection(sender)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            conn.send_nowait(b"hello")
            # Written before any checkpoint: nothing queued, no writer hop.
            assert conn.bytes_sent == 5 and conn.outbox_bytes == 0
            assert conn.peak_outbox_bytes == 0
            assert await receive_exactly(peer, 5) == b"hello"
            conn.finish()
    await sender.aclose()
    await peer.aclose()


SENDS = st.lists(
    st.lists(
        st.tuples(st.integers(0, 20_000), st.booleans(), st.booleans()), min_size=1, max_size=12
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(plan=SENDS, outbox=st.sampled_from([1_000, 16_000, 1 << 20]))
def test_direct_and_queued_sends_from_many_tasks_arrive_whole_and_in_order(
    plan: list[list[tuple[int, bool, bool]]], outbox: int
) -> None:
    """Each sender mixes ``send`` and ``send_nowait`` (sizes up to 5x the kernel
    buffers: writes go direct, partial, or queued behind the writer), sometimes
    yielding between them; the peer reads slowly. Every chunk arrives whole, each
    sender's in order, and the counters add up."""

    async def main() -> None:
        sender, peer = await tcp_pair()
        conn = PacketConnection(sender, max_outbox_bytes=outbox)
        total = sum(CHUNK_HEADER.size + size for sends in plan for size, _, _ in sends)

        async def produce(who: int, sends: list[tuple[int, bool, bool]]) -> None:
            for seq, (size, nowait, pause) in enumerate(sends):
                if nowait:
                    conn.send_nowait(chunk(who, seq, size))
                else:
                    await conn.send(chunk(who, seq, size))
                if pause:
                    await trio.lowlevel.checkpoint()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                conn.start_writer(nursery)
                async with trio.open_nursery() as producers:
                    for who, sends in enumerate(plan):
                        producers.start_soon(produce, who, sends)
                    received = await receive_exactly(peer, total)
                conn.finish()
                await conn.writer_done.wait()
        assert check_stream(received, len(plan)) == [len(sends) for sends in plan]
        assert conn.bytes_sent == total and conn.outbox_bytes == 0
        await sender.aclose()
        await peer.aclose()

    trio.run(main)


async def test_a_slow_peer_still_pushes_back_on_the_sender() -> None:
    sender, peer = await tcp_pair()
    outbox = 10_000
    conn = PacketConnection(sender, max_outbox_bytes=outbox)
    size = 4_000
    sent = 0

    async def producer() -> None:
        nonlocal sent
        while True:
            await conn.send(chunk(0, sent, size))
            sent += 1

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            nursery.start_soon(producer)
            await trio.testing.wait_all_tasks_blocked()
            # The kernel buffers filled, the direct writes stopped, the outbox filled.
            assert outbox <= conn.outbox_bytes <= outbox + CHUNK_HEADER.size + size
            assert conn.peak_outbox_bytes <= outbox + CHUNK_HEADER.size + size
            blocked_at = sent
            await trio.testing.wait_all_tasks_blocked()
            assert sent == blocked_at  # the sender waits for the peer
            received = await receive_exactly(peer, (blocked_at + 1) * (CHUNK_HEADER.size + size))
            nursery.cancel_scope.cancel()
    assert check_stream(received[: blocked_at * (CHUNK_HEADER.size + size)], 1) == [blocked_at]
    await sender.aclose()
    await peer.aclose()


async def cancel_when_blocked(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_a_cancelled_sender_loses_or_repeats_nothing() -> None:
    """A send cancelled while it waits for room sends nothing; one with room is
    written (never half) even in a cancelled scope; the stream stays whole."""
    sender, peer = await tcp_pair()
    conn = PacketConnection(sender, max_outbox_bytes=1_000)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            with trio.CancelScope() as scope:
                scope.cancel()
                await conn.send(chunk(0, 0, 100))  # room: written at once, not cancelled
            assert conn.bytes_sent == CHUNK_HEADER.size + 100
            conn.send_nowait(chunk(0, 1, 50_000))  # over the kernel buffers: the rest queues
            assert conn.outbox_bytes > 1_000
            with trio.CancelScope() as waiting:
                nursery.start_soon(cancel_when_blocked, waiting)
                await conn.send(chunk(0, 99, 100))  # no room: waits, then is cancelled
            assert waiting.cancelled_caught
            expected = 2 * CHUNK_HEADER.size + 100 + 50_000
            received = await receive_exactly(peer, expected)
            await conn.drain()
            await conn.send(chunk(0, 2, 10))
            received += await receive_exactly(peer, CHUNK_HEADER.size + 10)
            conn.finish()
    assert check_stream(received, 1) == [3]
    assert conn.bytes_sent == len(received)
    await sender.aclose()
    await peer.aclose()
