"""A 3.0-era DCP client's bytes, built by hand, and a reader that parses frames itself.

The frames are packed field by field as the Python clients of the 3.0 era
pack them (ep-engine management/mc_bin_client.py and the DCP test client
of the same release: a 24-byte header ``>BBHBBHIIQ``, then extras, key,
value), not through the project's encoder, so a misreading shared by our
encoder and our servers cannot hide. ``RawDcp`` reads replies with its own
header parser for the same reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import trio

from adapters.mcbp import Frame

HEADER = struct.Struct(">BBHBBHIIQ")
REQ, RES = 0x80, 0x81
OPEN, ADD_STREAM, CLOSE_STREAM, STREAM_REQ, FAILOVER_LOG = 0x50, 0x51, 0x52, 0x53, 0x54
STREAM_END, MARKER, MUTATION, DELETION, EXPIRATION = 0x55, 0x56, 0x57, 0x58, 0x59
SET_VBUCKET_STATE, NOOP, BUFFER_ACK, CONTROL = 0x5B, 0x5C, 0x5D, 0x5E
STAT, MC_NOOP = 0x10, 0x0A
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
PRODUCER, INCLUDE_DELETE_TIMES = 0x01, 0x20
TAKEOVER, DISKONLY, LATEST = 0x01, 0x02, 0x04
ACK = 0x08


def frame(
    opcode: int,
    *,
    magic: int = REQ,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    vbucket: int = 0,
    opaque: int = 0,
) -> bytes:
    body = len(extras) + len(key) + len(value)
    header = HEADER.pack(magic, opcode, len(key), len(extras), 0, vbucket, body, opaque, 0)
    return header + extras + key + value


def open_producer(name: bytes, flags: int = PRODUCER, opaque: int = 1) -> bytes:
    return frame(OPEN, extras=struct.pack(">II", 0, flags), key=name, opaque=opaque)


def control(key: bytes, value: bytes, opaque: int = 2) -> bytes:
    return frame(CONTROL, key=key, value=value, opaque=opaque)


def stream_req(
    vbucket: int,
    opaque: int,
    start: int = 0,
    end: int = MAX_SEQNO,
    *,
    flags: int = 0,
    uuid: int = 0,
    snap: tuple[int, int] | None = None,
) -> bytes:
    snap_start, snap_end = snap if snap is not None else (start, start)
    extras = struct.pack(">IIQQQQQ", flags, 0, start, end, uuid, snap_start, snap_end)
    return frame(STREAM_REQ, extras=extras, vbucket=vbucket, opaque=opaque)


def close_stream(vbucket: int, opaque: int) -> bytes:
    return frame(CLOSE_STREAM, vbucket=vbucket, opaque=opaque)


def buffer_ack(nbytes: int, opaque: int = 0) -> bytes:
    return frame(BUFFER_ACK, extras=struct.pack(">I", nbytes), opaque=opaque)


def stat(group: bytes, opaque: int = 0) -> bytes:
    return frame(STAT, key=group, opaque=opaque)


def reply(to: Reply, status: int = 0) -> bytes:
    """A consumer's answer to a producer request (NOOP, SET_VBUCKET_STATE, acked marker)."""
    return frame(to.opcode, magic=RES, vbucket=status, opaque=to.opaque)


def packet_of(frame: Frame) -> bytes:
    """A frame the project's reader decoded, as the bytes it came in (a relay passes
    each packet on exactly as it came)."""
    header = HEADER.pack(
        frame.magic, frame.opcode, frame.key_length, frame.extras_length, frame.datatype,
        frame.vbucket_or_status, len(frame.body), frame.opaque, frame.cas,
    )  # fmt: skip
    return header + frame.body


@dataclass
class Reply:
    magic: int
    opcode: int
    status: int
    """The vbucket field of a request."""
    opaque: int
    extras: bytes
    key: bytes
    value: bytes
    cas: int = 0

    @property
    def size(self) -> int:
        return HEADER.size + len(self.extras) + len(self.key) + len(self.value)

    @property
    def by_seqno(self) -> int:
        return int(struct.unpack_from(">Q", self.extras)[0])

    @property
    def marker_flags(self) -> int:
        return int(struct.unpack_from(">I", self.extras, 16)[0])


class RawDcp:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    @classmethod
    async def connect(cls, port: int) -> RawDcp:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, *data: bytes) -> None:
        await self.stream.send_all(b"".join(data))

    async def next(self) -> Reply | None:
        """The next frame, or None once the server closed the connection."""
        while True:
            if len(self.buffer) >= HEADER.size:
                magic, opcode, klen, elen, _, status, blen, opaque, cas = HEADER.unpack_from(
                    self.buffer
                )
                if len(self.buffer) >= HEADER.size + blen:
                    body = bytes(self.buffer[HEADER.size : HEADER.size + blen])
                    del self.buffer[: HEADER.size + blen]
                    return Reply(
                        magic, opcode, status, opaque,
                        body[:elen], body[elen : elen + klen], body[elen + klen :], cas,
                    )  # fmt: skip
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                return None
            self.buffer += data

    async def message(self, opaque: int | None = None) -> Reply:
        """The next message (with ``opaque`` when one is named), answering UPR NOOPs on
        the way, as a consumer does; the server must not close the connection."""
        while True:
            got = await self.next()
            assert got is not None, "the server closed the connection"
            if got.magic == REQ and got.opcode == NOOP:
                await self.send(reply(got))
                continue
            if opaque is None or got.opaque == opaque:
                return got

    async def response(self, opaque: int) -> Reply:
        """The response with ``opaque``, skipping anything else (answering NOOPs)."""
        while True:
            got = await self.next()
            assert got is not None, f"closed before the response to opaque {opaque}"
            if got.magic == RES and got.opaque == opaque:
                return got
            if got.magic == REQ and got.opcode == NOOP:
                await self.send(reply(got))

    async def stats(self, group: bytes, opaque: int = 0x5757) -> tuple[int, dict[str, str]]:
        """(status, pairs) of ``STAT group``."""
        await self.send(stat(group, opaque))
        pairs: dict[str, str] = {}
        while True:
            got = await self.response(opaque)
            if got.status != 0 or not got.key:
                return got.status, pairs
            pairs[got.key.decode()] = got.value.decode()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def producer(port: int, name: bytes, flags: int = PRODUCER) -> RawDcp:
    """A connection opened as a consumer of the producer on ``port`` (OPEN answered 0)."""
    client = await RawDcp.connect(port)
    await client.send(open_producer(name, flags, opaque=1))
    assert (await client.response(1)).status == 0
    return client


async def stats(port: int, group: bytes) -> tuple[int, dict[str, str]]:
    """``STAT group`` on a connection of its own, as cbstats asks."""
    admin = await RawDcp.connect(port)
    try:
        return await admin.stats(group)
    finally:
        await admin.aclose()


async def read_stream(client: RawDcp, opaque: int, *, answer_acks: bool = True) -> list[Reply]:
    """One stream's messages up to its STREAM_END, answering what a consumer answers."""
    out: list[Reply] = []
    while True:
        got = await client.message(opaque)
        out.append(got)
        if got.magic == REQ and got.opcode == SET_VBUCKET_STATE:
            await client.send(reply(got))
        if answer_acks and got.opcode == MARKER and got.marker_flags & ACK:
            await client.send(reply(got))
        if got.opcode == STREAM_END:
            return out


async def take_over(
    client: RawDcp,
    vbucket: int,
    opaque: int = 10,
    *,
    while_pending: Callable[[], object] | None = None,
) -> list[Reply]:
    """A takeover stream of ``vbucket`` to its end, answering what a consumer answers
    (``while_pending`` runs when SET_VBUCKET_STATE(pending) arrives, before its reply)."""
    await client.send(stream_req(vbucket, opaque=opaque, flags=TAKEOVER))
    assert (await client.response(opaque)).status == 0
    seen: list[Reply] = []
    while not seen or seen[-1].opcode != STREAM_END:
        got = await client.message()
        seen.append(got)
        if got.opcode == SET_VBUCKET_STATE:
            if got.extras == b"\x03" and while_pending is not None:
                while_pending()
            await client.send(reply(got))
        elif got.opcode == MARKER and got.marker_flags & ACK:
            await client.send(reply(got))
    return seen


async def newest_uuid(client: RawDcp, vbucket: int) -> int:
    """The vbucket uuid of the newest entry of ``vbucket``'s failover log."""
    await client.send(frame(FAILOVER_LOG, vbucket=vbucket, opaque=0xF0))
    got = await client.response(0xF0)
    assert got.status == 0
    return int(struct.unpack_from(">Q", got.value)[0])
