"""Packet connections: serving, batching, isolation of a faulty peer, backpressure."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from adapters.mcbp import Magic, Opcode, encode_frame
from gateway.io.connection import ConnectionLost, PacketConnection
from gateway.io.listen import bound_port, parse_hostport, serve_packets


async def noop_echo(conn: PacketConnection) -> None:
    while (frame := await conn.receive_frame()) is not None:
        await conn.send(encode_frame(Magic.RESPONSE, frame.opcode, opaque=frame.opaque))


async def test_faulty_peer_is_closed_alone(nursery: trio.Nursery) -> None:
    listeners = await nursery.start(partial(serve_packets, noop_echo, "127.0.0.1", 0, label="t"))
    port = bound_port(listeners)
    good = await PacketConnection.connect("127.0.0.1", port)
    bad = await trio.open_tcp_stream("127.0.0.1", port)
    assert (await good.request(Opcode.NOOP)).opcode == Opcode.NOOP
    await bad.send_all(b"\x42" * 24)  # bad magic
    assert await bad.receive_some(100) == b""  # closed by the server
    assert (await good.request(Opcode.NOOP)).opcode == Opcode.NOOP
    await good.aclose()
    await bad.aclose()


async def test_writer_batches_and_preserves_order() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = PacketConnection(left, max_outbox_bytes=1 << 20)
    packets = [encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=i) for i in range(500)]
    async with trio.open_nursery() as nursery:
        conn.start_writer(nursery)
        for packet in packets:
            conn.send_nowait(packet)
        conn.finish()
        received = b""
        while len(received) < len(b"".join(packets)):
            received += await right.receive_some()
    assert received == b"".join(packets)
    assert conn.bytes_sent == len(received)


async def test_send_waits_while_outbox_is_full() -> None:
    left, right = trio.testing.lockstep_stream_pair()
    conn = PacketConnection(left, max_outbox_bytes=1000)
    async with trio.open_nursery() as nursery:
        conn.start_writer(nursery)
        conn.send_nowait(b"x" * 1000)
        blocked = trio.Event()

        async def producer() -> None:
            await conn.send(b"y" * 10)
            blocked.set()

        nursery.start_soon(producer)
        await trio.testing.wait_all_tasks_blocked()
        assert not blocked.is_set()  # the peer reads nothing: the sender waits
        await right.receive_some(2000)
        await blocked.wait()
        conn.finish()
        nursery.cancel_scope.cancel()


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:11210") == ("127.0.0.1", 11210)
    assert parse_hostport(":0") == ("127.0.0.1", 0)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    for bad in ("host:port", "1:70000"):
        try:
            parse_hostport(bad)
        except ValueError as exc:
            assert bad in str(exc)
        else:
            raise AssertionError(bad)


async def test_every_sender_blocked_on_a_full_outbox_wakes_when_it_drains() -> None:
    # Several tasks waiting for room must all be woken, not just the last to wait.
    left, right = trio.testing.lockstep_stream_pair()
    conn = PacketConnection(left, max_outbox_bytes=100)
    chunk = b"x" * 150
    delivered = bytearray()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            conn.send_nowait(chunk)  # fills the outbox: every send below must wait
            async with trio.open_nursery() as senders:
                for _ in range(5):
                    senders.start_soon(conn.send, chunk)
                await trio.testing.wait_all_tasks_blocked()
                while len(delivered) < 6 * len(chunk):
                    delivered += await right.receive_some(1000)
            conn.finish()
    assert bytes(delivered) == chunk * 6


async def _answer_one_then_close(conn: PacketConnection) -> None:
    frame = await conn.receive_frame()
    assert frame is not None
    await conn.send(encode_frame(Magic.RESPONSE, frame.opcode, opaque=frame.opaque))


async def test_a_dialed_peer_that_closes_is_named(nursery: trio.Nursery) -> None:
    listeners = await nursery.start(
        partial(serve_packets, _answer_one_then_close, "127.0.0.1", 0, label="t")
    )
    port = bound_port(listeners)
    async with await PacketConnection.connect("127.0.0.1", port) as client:
        assert (await client.request(Opcode.NOOP)).opcode == Opcode.NOOP
        with pytest.raises(ConnectionLost, match=rf"^127\.0\.0\.1:{port} closed the connection"):
            await client.next_frame()


async def test_a_dialed_command_connection_becomes_a_stream(nursery: trio.Nursery) -> None:
    """Requests first, written at once; then a writer batches what the stream queues,
    in order after them, on the same socket and reader."""
    listeners = await nursery.start(partial(serve_packets, noop_echo, "127.0.0.1", 0, label="t"))
    client = await PacketConnection.connect("127.0.0.1", bound_port(listeners), name="dialed")
    assert (await client.request(Opcode.NOOP)).opaque == 1
    async with trio.open_nursery() as inner:
        client.start_writer(inner)
        for opaque in range(100, 200):
            client.send_nowait(encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=opaque))
        await client.send(encode_frame(Magic.REQUEST, Opcode.NOOP, opaque=200))
        got = [(await client.next_frame()).opaque for _ in range(101)]
        client.finish()
    assert got == list(range(100, 201))
    await client.aclose()


@pytest.mark.parametrize(
    ("first_bytes", "hint"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "the peer speaks HTTP"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(13), "the peer speaks TLS"),
    ],
)
async def test_an_http_or_tls_peer_is_named_in_the_closing_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, first_bytes: bytes, hint: str
) -> None:
    listeners = await nursery.start(partial(serve_packets, noop_echo, "127.0.0.1", 0, label="t"))
    peer = await trio.open_tcp_stream("127.0.0.1", bound_port(listeners))
    await peer.send_all(first_bytes)
    assert await peer.receive_some(100) == b""  # closed by the server
    await peer.aclose()
    (line,) = [r.getMessage() for r in caplog.records if "closing connection" in r.getMessage()]
    assert "bad magic byte" in line and hint in line


async def test_a_bad_magic_later_in_a_stream_gets_no_protocol_hint(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    listeners = await nursery.start(partial(serve_packets, noop_echo, "127.0.0.1", 0, label="t"))
    peer = await trio.open_tcp_stream("127.0.0.1", bound_port(listeners))
    await peer.send_all(
        encode_frame(Magic.REQUEST, Opcode.NOOP) + b"GET / HTTP/1.1\r\n\r\n" + bytes(8)
    )
    assert await peer.receive_some(100) != b""  # the NOOP's answer
    while await peer.receive_some(100):
        pass
    await peer.aclose()
    (line,) = [r.getMessage() for r in caplog.records if "closing connection" in r.getMessage()]
    assert "bad magic byte" in line and "speaks" not in line
