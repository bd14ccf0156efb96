"""Limits every listener (node, TAP front, UPR front) puts on peers that have not
proved themselves: frame sizes by stage, handshake, idle and per-frame timeouts,
and the number of open connections.

memcached of the 2.x/3.0 servers (daemon/memcached.c) caps connections at 1000 by
default (``settings_init``: ``settings.maxconns``), the default of
``--max-connections`` here, and bounds a SASL mechanism name before reading a
SASL body (``process_bin_sasl_auth``: MAX_SASL_MECH_LEN). The stage limits go
further: until a peer has authenticated (SASL) and opened a stream (TAP
CONNECT / UPR OPEN) only small frames are read at all, each refused from its
header before any of its body is buffered.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.errors import ProtocolError
from adapters.mcbp import HEADER_SIZE, Magic, Opcode, encode_frame
from adapters.tap import ConnectFlags, TapOpcode, encode
from gateway.io.connection import PacketConnection
from gateway.io.limits import ConnectionLimits, Stage
from gateway.io.listen import bound_port, serve_packets
from tests.gateway.listeners import (
    KINDS,
    read_until_closed,
    request,
    sasl,
    start_listener,
)
from tests.support.tap_client import connect_event, until

USERS = {"alice": "wonder"}


def oversized_header(opcode: int, body: int) -> bytes:
    """A request header declaring ``body`` bytes, with none of them sent."""
    return struct.pack(">BBHBBHIIQ", Magic.REQUEST, opcode, 0, 0, 0, 0, body, 1, 0)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_large_frame_before_authentication_is_refused_from_its_header(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    listener = await start_listener(nursery, kind, tmp_path, users=USERS)
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await stream.send_all(oversized_header(Opcode.SASL_AUTH, 20 * 1024 * 1024))
        assert await read_until_closed(stream) == b""
        await stream.aclose()
    assert listener.counters.frames_refused_total[kind, "auth"] == 1
    assert "frames before SASL authentication are limited to 4096 bytes" in caplog.text
    assert "opcode=0x21" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
async def test_after_authentication_larger_frames_pass(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    listener = await start_listener(nursery, kind, tmp_path, users=USERS)
    with trio.fail_after(20):
        async with await PacketConnection.connect("127.0.0.1", listener.port) as client:
            await client.sasl_plain("alice", "wonder")
            # 8 KiB: over the pre-auth limit, under the pre-stream one
            reply = await client.request(Opcode.NOOP, key=b"k" * 8192, check=False)
            assert reply.opcode == Opcode.NOOP
            if kind == "node":  # a memcached command connection: items of any size
                await client.request(Opcode.SET, key=b"big", value=b"v" * 100_000, extras=bytes(8))
                assert len((await client.request(Opcode.GET, key=b"big")).value) == 100_000


@pytest.mark.parametrize("kind", ["tap-front", "upr-front"])
async def test_fronts_limit_frames_before_connect_or_open(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    listener = await start_listener(nursery, kind, tmp_path)
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await stream.send_all(oversized_header(Opcode.STAT, 17 * 1024))
        assert await read_until_closed(stream) == b""
        await stream.aclose()
    assert listener.counters.frames_refused_total[kind, "command"] == 1


async def test_a_tap_connect_for_1024_vbuckets_with_checkpoints_fits_before_streaming(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    listener = await start_listener(nursery, "tap-front", tmp_path)
    event = connect_event(
        b"wide",
        ConnectFlags.LIST_VBUCKETS | ConnectFlags.CHECKPOINT | ConnectFlags.DUMP,
        vbuckets=tuple(range(1024)),
        checkpoints=tuple((vb, 1) for vb in range(1024)),
    )
    packet = encode(event)
    assert len(packet) > 12_000
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await stream.send_all(packet)
        # Read whole and accepted: the node has 4 vbuckets, the others are
        # skipped as 2.x did, and the dump ends with no refusal sent.
        received = await read_until_closed(stream)
        assert not received.startswith(bytes([Magic.RESPONSE]))
        await stream.aclose()
    assert not listener.counters.frames_refused_total


@pytest.mark.parametrize("kind", KINDS)
async def test_a_peer_that_never_authenticates_is_closed(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    limits = ConnectionLimits(handshake_timeout=0.3)
    listener = await start_listener(nursery, kind, tmp_path, users=USERS, limits=limits)
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await stream.send_all(request(Opcode.NOOP))  # answered, but no authentication
        assert await read_until_closed(stream)  # the NOOP reply, then the close
        await stream.aclose()
    assert listener.counters.timeouts_total[kind, "handshake"] == 1
    assert "no SASL authentication within 0.3s" in caplog.text


@pytest.mark.parametrize("kind", ["tap-front", "upr-front"])
async def test_an_idle_connection_without_connect_or_open_is_closed(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    limits = ConnectionLimits(handshake_timeout=0.3, command_idle_timeout=0.3)
    listener = await start_listener(nursery, kind, tmp_path, users=USERS, limits=limits)
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        await stream.send_all(sasl("alice", "wonder"))
        assert await read_until_closed(stream)  # "Authenticated", then the close
        await stream.aclose()
    assert listener.counters.timeouts_total[kind, "idle"] == 1
    assert not listener.counters.timeouts_total[kind, "handshake"]


async def test_the_node_lets_an_authenticated_command_connection_idle(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    limits = ConnectionLimits(handshake_timeout=0.2, command_idle_timeout=None)
    listener = await start_listener(nursery, "node", tmp_path, users=USERS, limits=limits)
    with trio.fail_after(20):
        async with await PacketConnection.connect("127.0.0.1", listener.port) as client:
            await client.sasl_plain("alice", "wonder")
            # Past the handshake timeout, authenticated: still served.
            await trio.sleep(0.5)
            assert (await client.request(Opcode.NOOP)).opcode == Opcode.NOOP
    assert not listener.counters.timeouts_total


@pytest.mark.parametrize("kind", KINDS)
async def test_a_header_trickled_byte_by_byte_is_cut_off(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    limits = ConnectionLimits(frame_timeout=0.3)
    listener = await start_listener(nursery, kind, tmp_path, limits=limits)
    header = request(Opcode.NOOP)[:HEADER_SIZE]
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        closed = trio.Event()

        async def trickle() -> None:
            for byte in header[:-1]:
                try:
                    await stream.send_all(bytes([byte]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                # The peer being slow (what the test plays), not a wait for a result.
                with trio.move_on_after(0.1):
                    await closed.wait()

        async with trio.open_nursery() as inner:
            inner.start_soon(trickle)
            assert await read_until_closed(stream) == b""
            closed.set()
        await stream.aclose()
    assert listener.counters.timeouts_total[kind, "frame"] == 1
    assert "a frame not complete within 0.3s" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
async def test_connections_past_the_limit_are_refused_logged_and_counted(
    nursery: trio.Nursery, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    limits = ConnectionLimits(max_connections=2)
    listener = await start_listener(nursery, kind, tmp_path, limits=limits)
    with trio.fail_after(20):
        first = await PacketConnection.connect("127.0.0.1", listener.port)
        second = await PacketConnection.connect("127.0.0.1", listener.port)
        for client in (first, second):  # both accepted and served
            await client.request(Opcode.NOOP)
        third = await trio.open_tcp_stream("127.0.0.1", listener.port)
        assert await read_until_closed(third) == b""
        await third.aclose()
        assert listener.counters.refusals_total[kind] == 1
        assert f"{kind}: refused connection from 127.0.0.1:" in caplog.text
        assert "2 connections open (--max-connections)" in caplog.text
        assert listener.counters.open_connections[kind] == 2
        await first.aclose()
        # Room again once the server has seen one go.
        await until(lambda: listener.counters.open_connections[kind] == 1)
        fourth = await PacketConnection.connect("127.0.0.1", listener.port)
        await fourth.request(Opcode.NOOP)
        await fourth.aclose()
        await second.aclose()


async def test_stages_set_the_frame_limit_of_a_connection() -> None:
    limits = ConnectionLimits(pre_auth_frame_size=100, command_frame_size=1000)

    async def handler(conn: PacketConnection) -> None:
        while (frame := await conn.receive_frame()) is not None:
            if frame.opcode == Opcode.SASL_AUTH:
                conn.authenticated()
            elif frame.opcode == TapOpcode.CONNECT:
                conn.streaming()
            await conn.send(encode_frame(Magic.RESPONSE, frame.opcode, opaque=frame.opaque))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            lambda task_status: serve_packets(
                handler,
                "127.0.0.1",
                0,
                label="t",
                limits=limits,
                auth_required=True,
                task_status=task_status,
            )
        )
        port = bound_port(listeners)
        with trio.fail_after(20):
            async with await PacketConnection.connect("127.0.0.1", port) as client:
                await client.request(Opcode.NOOP, key=b"k" * 90)
                await client.request(Opcode.SASL_AUTH)
                await client.request(Opcode.NOOP, key=b"k" * 900)
                await client.request(TapOpcode.CONNECT)
                await client.request(Opcode.NOOP, value=b"v" * 100_000)
            for before in (b"", Opcode.SASL_AUTH):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                if before:
                    await stream.send_all(request(Opcode.SASL_AUTH))
                await stream.send_all(request(Opcode.NOOP, key=b"k" * 1001))
                received = await read_until_closed(stream)
                assert len(received) == (HEADER_SIZE if before else 0)
                await stream.aclose()
        nursery.cancel_scope.cancel()
    assert limits.frame_size(Stage.AUTH) == 100


steps = st.lists(
    st.one_of(
        st.tuples(st.just("frame"), st.integers(0, 3000)),
        st.tuples(st.sampled_from(["authenticated", "streaming"]), st.just(0)),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_a_frame_passes_exactly_when_its_stage_allows_its_size(
    plan: list[tuple[str, int]],
) -> None:
    """Stage moves in any order: each frame is read whole or refused from its header."""
    limits = ConnectionLimits(pre_auth_frame_size=500, command_frame_size=1500)

    async def run() -> None:
        left, right = trio.testing.memory_stream_pair()
        conn = PacketConnection(left, limits=limits, stage=Stage.AUTH)
        stage = Stage.AUTH
        for action, size in plan:
            if action == "authenticated":
                conn.authenticated()
                stage = Stage.COMMAND if stage is Stage.AUTH else stage
                continue
            if action == "streaming":
                conn.streaming()
                stage = Stage.STREAM
                continue
            await right.send_all(request(Opcode.NOOP, value=b"v" * size))
            if size <= limits.frame_size(stage):
                frame = await conn.receive_frame()
                assert frame is not None and len(frame.body) == size
            else:
                with pytest.raises(ProtocolError, match="are limited to"):
                    await conn.receive_frame()
                return
        assert conn.stage is stage

    trio.run(run)
