"""A scripted ep-engine 2.5.1 TAP producer: the frames a real 2.5.1 node sends.

The frames are packed here, field by field, from what memcached 2.5
``daemon/memcached.c`` ``ship_tap_log`` writes for each event ep-engine 2.5.1
``src/ep_engine.cc`` ``doWalkTapQueue`` hands it, and not with
``adapters.tap``'s encoder, so a mistake the codec shares with the reference
node cannot pass a test built on these:

- every message: magic 0x80, the TAP sequence number as the header opaque
  (0 on a NOOP), extras length 8 (16 on MUTATION and CHECKPOINT_START/END),
  the TAP header (engine-specific length, TAP flags, TTL 255, 3 reserved);
- NOOP: the bare 24-byte header, opcode 0x0a, nothing else;
- MUTATION: item flags, expiration, then the engine-specific rev_seqno u64 and
  nru u8 (``TapEngineSpecific::packSpecificData``: 9 bytes), key, value.
  Without TAP_FLAG_NETWORK_BYTE_ORDER the item flags go out ``htonl``-ed from
  2.x's stored order, i.e. byte-swapped from what the client set;
- DELETE: engine-specific rev_seqno (8), key, then the item's value unless
  TAP_FLAG_NO_VALUE (an expired item found by a disk backfill still has one);
- CHECKPOINT_START/END: the mutation layout, key ``checkpoint_start`` /
  ``checkpoint_end``, value the 8-byte checkpoint id; START carries 8
  engine-specific bytes (the vbucket's max deleted rev_seqno), END none;
- OPAQUE / VBUCKET_SET: 4 engine-specific bytes (the opaque code, the state),
  network order; FLUSH: none, vbucket 0 (a flush of the whole bucket).

``Tap251Node`` serves these to the UPR front's ingest: each TAP connection's
CONNECT is recorded and handed to the test's ``play`` coroutine with a
``Session`` that sends frames and waits for the acks, as 2.5.1 waits for the
ack of an OPAQUE or checkpoint message before it sends the next item
(``TapProducer::waitForOpaqueMsgAck`` / ``waitForCheckpointMsgAck``).
"""

from __future__ import annotations

import contextlib
import struct
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import trio

from tests.support.waiting import until

_HEADER = struct.Struct(">BBHBBHIIQ")
_TAP = struct.Struct(">HHB3x")
_ITEM = struct.Struct(">II")
REQUEST, RESPONSE = 0x80, 0x81
NOOP = 0x0A
CONNECT, MUTATION, DELETE, FLUSH, OPAQUE, VBUCKET_SET = 0x40, 0x41, 0x42, 0x43, 0x44, 0x45
CHECKPOINT_START, CHECKPOINT_END = 0x46, 0x47
DEREGISTER_TAP_CLIENT = 0x9E
FLAG_ACK, FLAG_NO_VALUE, FLAG_NETWORK_BYTE_ORDER = 0x01, 0x02, 0x04
STREAMED = (1, 2)
"""Vbuckets the front streams: not 0, where 2.5.1 sends its connection-wide OPAQUEs."""
ENABLE_AUTO_NACK, INITIAL_VBUCKET_STREAM, ENABLE_CHECKPOINT_SYNC = 0, 1, 2
OPEN_CHECKPOINT, COMPLETE_VB_FILTER_CHANGE, CLOSE_TAP_STREAM, CLOSE_BACKFILL = 3, 4, 7, 8
TTL = 255
"""``doWalkTapQueue`` sets every message's TTL to (uint8_t)-1."""
INITIAL_NRU = 2


def _frame(opcode: int, body: bytes, *, extlen: int, keylen: int = 0, vbucket: int = 0,
           opaque: int = 0, cas: int = 0) -> bytes:  # fmt: skip
    return _HEADER.pack(REQUEST, opcode, keylen, extlen, 0, vbucket, len(body), opaque, cas) + body


def noop() -> bytes:
    return _HEADER.pack(REQUEST, NOOP, 0, 0, 0, 0, 0, 0, 0)


def mutation(vbucket: int, key: bytes, value: bytes, *, seqno: int, cas: int, flags: int = 0,
             expiration: int = 0, rev_seqno: int = 1, nru: int = INITIAL_NRU, ack: bool = False,
             network_order: bool = True, ttl: int = TTL) -> bytes:  # fmt: skip
    """``flags`` as the client set them; on the wire swapped unless ``network_order``."""
    tap_flags = (FLAG_ACK if ack else 0) | (FLAG_NETWORK_BYTE_ORDER if network_order else 0)
    wire_flags = flags if network_order else int.from_bytes(flags.to_bytes(4, "big"), "little")
    es = struct.pack(">QB", rev_seqno, nru)
    body = _TAP.pack(len(es), tap_flags, ttl) + _ITEM.pack(wire_flags, expiration) + es
    return _frame(MUTATION, body + key + value, extlen=16, keylen=len(key), vbucket=vbucket,
                  opaque=seqno, cas=cas)  # fmt: skip


def delete(vbucket: int, key: bytes, *, seqno: int, cas: int, rev_seqno: int = 1,
           value: bytes = b"", ack: bool = False) -> bytes:  # fmt: skip
    es = struct.pack(">Q", rev_seqno)
    body = _TAP.pack(len(es), FLAG_ACK if ack else 0, TTL) + es + key + value
    return _frame(DELETE, body, extlen=8, keylen=len(key), vbucket=vbucket, opaque=seqno, cas=cas)


def checkpoint(opcode: int, vbucket: int, checkpoint_id: int, *, seqno: int,
               max_deleted_rev: int = 0, ack: bool = True) -> bytes:  # fmt: skip
    start = opcode == CHECKPOINT_START
    key = b"checkpoint_start" if start else b"checkpoint_end"
    es = struct.pack(">Q", max_deleted_rev) if start else b""
    body = _TAP.pack(len(es), FLAG_ACK if ack else 0, TTL) + _ITEM.pack(0, 0) + es
    body += key + struct.pack(">Q", checkpoint_id)
    return _frame(opcode, body, extlen=16, keylen=len(key), vbucket=vbucket, opaque=seqno)


def _u32_message(opcode: int, vbucket: int, value: int, seqno: int, ack: bool) -> bytes:
    body = _TAP.pack(4, FLAG_ACK if ack else 0, TTL) + struct.pack(">I", value)
    return _frame(opcode, body, extlen=8, vbucket=vbucket, opaque=seqno)


def opaque(vbucket: int, code: int, *, seqno: int, ack: bool = True) -> bytes:
    return _u32_message(OPAQUE, vbucket, code, seqno, ack)


def vbucket_set(vbucket: int, state: int, *, seqno: int, ack: bool = True) -> bytes:
    return _u32_message(VBUCKET_SET, vbucket, state, seqno, ack)


def flush(*, seqno: int, ack: bool = True) -> bytes:
    return _frame(FLUSH, _TAP.pack(0, FLAG_ACK if ack else 0, TTL), extlen=8, opaque=seqno)


@dataclass(frozen=True)
class Response:
    opcode: int
    opaque: int
    status: int
    body: bytes


@dataclass
class Connect:
    name: bytes
    flags: int
    value: bytes


@dataclass
class Session:
    """One TAP connection from the ingest, once it sent CONNECT."""

    stream: trio.SocketStream
    connect: Connect
    responses: list[Response] = field(default_factory=list)
    closed: trio.Event = field(default_factory=trio.Event)
    """The ingest closed the connection."""
    seqno: int = 0

    def next(self) -> int:
        """The next TAP sequence number (2.5.1 starts at 1, ``tap_ack_initial_sequence_number``)."""
        self.seqno += 1
        return self.seqno

    async def send(self, *frames: bytes) -> None:
        await self.stream.send_all(b"".join(frames))

    async def send_acked(self, *frames: bytes) -> Response:
        """Send ``frames`` and wait for the ack of the last one, as 2.5.1 sends nothing
        after an OPAQUE or checkpoint message (or an item asking for an ack) until then."""
        await self.send(*frames)
        return await self.wait_ack(self.seqno)

    def acked(self, seqno: int) -> bool:
        return any(r.opaque == seqno and r.opcode != NOOP for r in self.responses)

    async def wait_ack(self, seqno: int) -> Response:
        await until(lambda: self.acked(seqno) or self.closed.is_set())
        found = [r for r in self.responses if r.opaque == seqno and r.opcode != NOOP]
        assert found, f"the ingest closed the connection before answering #{seqno}"
        return found[0]


Play = Callable[[Session], Awaitable[None]]


async def _read_frame(
    stream: trio.SocketStream, buffer: bytearray
) -> tuple[tuple[int, ...], bytes] | None:
    while True:
        if len(buffer) >= 24:
            header = _HEADER.unpack_from(buffer)
            end = 24 + header[6]
            if len(buffer) >= end:
                body = bytes(buffer[24:end])
                del buffer[:end]
                return header, body
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None  # the ingest's reset, or the script closed it
        if not data:
            return None
        buffer += data


class Tap251Node:
    """Serves each TAP connection with ``play`` (see the module docstring); after
    ``play`` returns, the connection stays open and its responses are still read."""

    def __init__(self, play: Play) -> None:
        self.play = play
        self.sessions: list[Session] = []
        self.deregistered = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        while True:
            got = await _read_frame(stream, buffer)
            if got is None:
                return
            header, body = got
            opcode, keylen, extlen = header[1], header[2], header[3]
            if opcode == DEREGISTER_TAP_CLIENT:
                self.deregistered += 1
                await stream.send_all(_HEADER.pack(RESPONSE, opcode, 0, 0, 0, 0, 0, header[7], 0))
                continue
            assert opcode == CONNECT, f"unexpected opcode 0x{opcode:02x} before CONNECT"
            flags = struct.unpack_from(">I", body)[0] if extlen == 4 else 0
            connect = Connect(body[extlen : extlen + keylen], flags, body[extlen + keylen :])
            break
        session = Session(stream, connect)
        self.sessions.append(session)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._responses, session, buffer)
            with contextlib.suppress(trio.BrokenResourceError):  # the ingest closed it
                await self.play(session)
            await session.closed.wait()
            nursery.cancel_scope.cancel()

    async def _responses(self, session: Session, buffer: bytearray) -> None:
        try:
            while (got := await _read_frame(session.stream, buffer)) is not None:
                header, body = got
                assert header[0] == RESPONSE, f"a request 0x{header[1]:02x} from the consumer"
                session.responses.append(Response(header[1], header[7], header[5], body))
        finally:
            session.closed.set()

    async def start(self, nursery: trio.Nursery) -> int:
        """Listen on a loopback port; the port."""
        listeners = await nursery.start(partial(trio.serve_tcp, self.serve, 0, host="127.0.0.1"))
        return int(listeners[0].socket.getsockname()[1])


async def backfill(s: Session, items: dict[int, list[tuple[bytes, bytes]]]) -> None:
    """2.5.1's start of a backfilling registered client with checkpoints."""
    for code in (ENABLE_AUTO_NACK, ENABLE_CHECKPOINT_SYNC):
        await s.send(opaque(0, code, seqno=s.next()))
    for vb in STREAMED:
        await s.send(opaque(vb, INITIAL_VBUCKET_STREAM, seqno=s.next()))
    await s.wait_ack(s.seqno)  # paused: an OPAQUE is unacked
    rows = [(vb, k, v) for n in range(max(map(len, items.values())))
            for vb in STREAMED for k, v in items[vb][n : n + 1]]  # fmt: skip
    for n, (vb, key, value) in enumerate(rows):
        last = n == len(rows) - 1  # the queue ran empty: an ack is asked for
        cas = zlib.crc32(b"%d:%s:%s" % (vb, key, value))  # a new value, a new cas
        await s.send(mutation(vb, key, value, seqno=s.next(), cas=cas, flags=0x01020304,
                                network_order=n % 2 == 0, ack=last))  # fmt: skip
    await s.wait_ack(s.seqno)
    for vb in STREAMED:
        await s.send(opaque(vb, CLOSE_BACKFILL, seqno=s.next()))
    await s.wait_ack(s.seqno)
