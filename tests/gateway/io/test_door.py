"""The command door every listener shares (``gateway.io.door``).

The answers follow memcached's binary protocol as 2.x/3.0 servers gave them
(memcached daemon/memcached.c: ``dispatch_bin_command`` answers NOOP, VERSION
and SASL_LIST_MECHS, ``process_bin_sasl_auth`` SASL PLAIN, and any other
opcode gets UNKNOWN_COMMAND with the connection left open).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, FrameReader, Magic, Opcode, Status, encode_frame
from gateway.io.auth import Authenticator, Users
from gateway.io.door import Door
from gateway.io.limits import ConnectionLimits, ListenerCounters
from gateway.io.replies import error_reply, reply
from gateway.io.stat_replies import StatError
from tests.gateway.listeners import KINDS, request, sasl, start_listener

CBSASL_MECHS = b"CRAM-MD5 PLAIN"
"""couchbase/cbsasl src/cbsasl.c ``cbsasl_list_mechs``, as memcached 2.5/3.0 answered."""


@dataclass
class FakeConnection:
    """What the door needs of a connection: frames in, bytes out, its stage."""

    frames: list[Frame]
    sent: list[bytes] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)
    name: str = "test 127.0.0.1:1"
    authority: Any = None

    async def receive_frame(self) -> Frame | None:
        return self.frames.pop(0) if self.frames else None

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    def authenticated(self) -> None:
        self.stages.append("command")

    def streaming(self) -> None:
        self.stages.append("stream")


def frame_of(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame


async def group_stats(group: str) -> list[tuple[str, str]]:
    if group == "bad":
        raise StatError("no such group")
    return [("a", "1"), ("b", "2")]


def door(users: Users | None = None, **hooks: Any) -> Door:
    return Door("t", users, ConnectionLimits(), ListenerCounters(), "v1", group_stats, **hooks)


async def serve(d: Door, *requests: bytes) -> FakeConnection:
    conn = FakeConnection([frame_of(r) for r in requests])
    await d.serve(conn)  # type: ignore[arg-type]
    return conn


async def test_common_commands_are_answered_alike() -> None:
    noop, version = request(Opcode.NOOP, opaque=7), request(Opcode.VERSION, opaque=8)
    mechs, stat = request(Opcode.SASL_LIST_MECHS), request(Opcode.STAT, key=b"x")
    unknown, bad_stat = request(0x99), request(Opcode.STAT, key=b"bad")
    conn = await serve(door(), noop, version, mechs, stat, unknown, bad_stat)
    assert conn.sent == [
        reply(frame_of(noop)),
        reply(frame_of(version), value=b"v1"),
        reply(frame_of(mechs), value=CBSASL_MECHS),
        reply(frame_of(stat), key=b"a", value=b"1")
        + reply(frame_of(stat), key=b"b", value=b"2")
        + reply(frame_of(stat)),
        error_reply(frame_of(unknown), Status.UNKNOWN_COMMAND, "unknown command 0x99"),
        error_reply(frame_of(bad_stat), Status.KEY_NOT_FOUND, "no such group"),
    ]
    assert conn.stages == []


async def test_only_open_opcodes_before_sasl_then_everything() -> None:
    users = Users.of({"alice": "pw"})
    stat, noop, login = request(Opcode.STAT), request(Opcode.NOOP), sasl("alice", "pw")
    conn = await serve(door(users), stat, noop, login, stat)
    assert conn.sent[0] == error_reply(frame_of(stat), Status.AUTH_ERROR, "authenticate first")
    assert conn.sent[1] == reply(frame_of(noop))
    assert conn.sent[2] == reply(frame_of(login), value=b"Authenticated")
    assert conn.sent[3].startswith(reply(frame_of(stat), key=b"a", value=b"1"))
    assert conn.stages == ["command"]


async def test_full_frames_roles_stream_sized_from_the_start_or_after_sasl() -> None:
    assert (await serve(door(full_frames=True))).stages == ["stream"]
    users = Users.of({"alice": "pw"})
    conn = await serve(door(users, full_frames=True), sasl("alice", "pw"))
    assert conn.stages == ["stream"]


async def test_stream_opcodes_go_to_the_role_until_it_keeps_the_connection() -> None:
    seen: list[int] = []

    async def begin(conn: Any, frame: Frame, auth: Authenticator) -> bool:
        seen.append(frame.opaque)
        assert conn.authority is auth
        return frame.opaque == 2

    conn = await serve(
        door(stream_opcodes={0x40}, begin_stream=begin),
        request(0x40, opaque=1),
        request(0x40, opaque=2),
        request(Opcode.NOOP),
    )
    assert seen == [1, 2]
    assert conn.sent == []  # the role answered (here: nothing); the NOOP was never read


async def test_answer_serves_a_streaming_connection_as_the_command_one() -> None:
    """memcached daemon/memcached.c ``conn_ship_log``: a TAP or UPR connection's
    packets go through the command dispatcher, so a stream's reader hands the
    requests its protocol does not own to ``Door.answer``."""
    seen: list[int] = []

    async def command(conn: Any, frame: Frame, auth: Authenticator) -> None:
        assert auth is conn.authority
        seen.append(frame.opcode)
        await conn.send(reply(frame, value=b"mine"))

    d = door(command=command)
    conn = FakeConnection([])
    d.authenticator(conn)  # type: ignore[arg-type]
    version, stat, get = request(Opcode.VERSION), request(Opcode.STAT, key=b"x"), request(0x00)
    for data in (version, stat, get):
        await d.answer(conn, frame_of(data))  # type: ignore[arg-type]
    assert conn.sent == [
        reply(frame_of(version), value=b"v1"),
        reply(frame_of(stat), key=b"a", value=b"1")
        + reply(frame_of(stat), key=b"b", value=b"2")
        + reply(frame_of(stat)),
        reply(frame_of(get), value=b"mine"),
    ]
    assert seen == [0x00]


async def test_a_response_before_any_stream_closes_with_the_roles_text() -> None:
    counted: list[int] = []
    stray = encode_frame(Magic.RESPONSE, Opcode.NOOP)
    d = door(
        stray_response="a response before any stream", on_stray_response=lambda: counted.append(1)
    )
    with pytest.raises(ProtocolError, match="a response before any stream"):
        await serve(d, stray)
    assert counted == [1]


@pytest.mark.parametrize("kind", KINDS)
async def test_every_listener_answers_the_common_commands_with_the_same_bytes(
    nursery: trio.Nursery, tmp_path: Path, kind: str
) -> None:
    listener = await start_listener(nursery, kind, tmp_path)
    requests = [request(Opcode.NOOP, opaque=3), request(Opcode.SASL_LIST_MECHS), request(0x99)]
    expected = [
        reply(frame_of(requests[0])),
        reply(frame_of(requests[1]), value=CBSASL_MECHS),
        error_reply(frame_of(requests[2]), Status.UNKNOWN_COMMAND, "unknown command 0x99"),
    ]
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
        async with stream:
            await stream.send_all(b"".join(requests))
            received = b""
            while len(received) < sum(map(len, expected)):
                received += await stream.receive_some(65536)
    assert received == b"".join(expected)
