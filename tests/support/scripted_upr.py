"""A scripted 3.0 UPR producer: the upstream a TAP front reads, playing given bytes.

The reference node sends only what its own code makes; a released 3.0
producer (ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::step``,
src/upr-stream.cc ``ActiveStream``) sends more: markers whose range starts
below the stream's start, empty snapshots, items with extended metadata,
STREAM_END with each reason. ``ScriptedUpr`` answers what a TAP front asks
before streaming (``STAT vbucket``, ``STAT vbucket-seqno``, OPEN, CONTROL)
as a 3.0 node does, then hands each STREAM_REQ to the test's ``play``,
which sends whatever frames it wants. Frames are packed field by field
(``tests.support.raw_dcp``), not with the project's encoder, so a misreading
the encoder shares cannot hide. Everything the consumer sends after the
handshake is kept in ``received``.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from tests.support.raw_dcp import (
    BUFFER_ACK,
    CONTROL,
    DELETION,
    EXPIRATION,
    HEADER,
    MARKER,
    MUTATION,
    NOOP,
    OPEN,
    REQ,
    RES,
    STAT,
    STREAM_END,
    STREAM_REQ,
    Reply,
    frame,
)

MEMORY, DISK, CHECKPOINT = 0x01, 0x02, 0x04


@dataclass(frozen=True)
class Request:
    """A STREAM_REQ as the consumer sent it."""

    vbucket: int
    opaque: int
    flags: int
    start: int
    end: int
    uuid: int
    snap_start: int
    snap_end: int


def marker(opaque: int, start: int, end: int, flags: int, vbucket: int = 0) -> bytes:
    """SNAPSHOT_MARKER (v3.0.0 src/upr-response.h ``SnapshotMarker``: 20 bytes of extras)."""
    extras = struct.pack(">QQI", start, end, flags)
    return frame(MARKER, extras=extras, opaque=opaque, vbucket=vbucket)


def mutation(
    opaque: int,
    seqno: int,
    key: bytes,
    value: bytes = b"v",
    *,
    meta: bytes = b"",
    lock_time: int = 0,
    flags: int = 0,
    vbucket: int = 0,
) -> bytes:
    """MUTATION in the 3.0 layout: 31 bytes of extras, key, value, nmeta bytes of meta."""
    extras = struct.pack(">QQIIIHB", seqno, 1, flags, 0, lock_time, len(meta), 0)
    return frame(
        MUTATION, extras=extras, key=key, value=value + meta, opaque=opaque, vbucket=vbucket
    )


def deletion(
    opaque: int, seqno: int, key: bytes, *, meta: bytes = b"", opcode: int = DELETION
) -> bytes:
    """DELETION (or EXPIRATION) in the 3.0 layout: 18 bytes of extras, key, meta."""
    extras = struct.pack(">QQH", seqno, 1, len(meta))
    return frame(opcode, extras=extras, key=key, value=meta, opaque=opaque)


def expiration(opaque: int, seqno: int, key: bytes) -> bytes:
    return deletion(opaque, seqno, key, opcode=EXPIRATION)


def stream_end(opaque: int, reason: int, vbucket: int = 0) -> bytes:
    return frame(STREAM_END, extras=struct.pack(">I", reason), opaque=opaque, vbucket=vbucket)


def noop(opaque: int) -> bytes:
    """A producer's NOOP (v3.0.0 src/upr-producer.cc ``maybeSendNoop``): not counted
    in the flow-control buffer, sent whatever else waits."""
    return frame(NOOP, opaque=opaque)


def stream_ok(request: Request, failover: tuple[tuple[int, int], ...] = ((0xABC, 0),)) -> bytes:
    """The STREAM_REQ success answer: the failover log in the value."""
    value = b"".join(struct.pack(">QQ", uuid, seqno) for uuid, seqno in failover)
    return frame(STREAM_REQ, magic=RES, value=value, opaque=request.opaque)


Play = Callable[["Channel", Request], Awaitable[None]]


@dataclass
class Channel:
    """One UPR connection of the scripted producer."""

    stream: trio.SocketStream
    upr: ScriptedUpr
    _sending: trio.StrictFIFOLock = field(default_factory=trio.StrictFIFOLock)

    async def send(self, *data: bytes) -> None:
        async with self._sending:
            await self.stream.send_all(b"".join(data))

    async def send_counted(self, *data: bytes) -> None:
        """Send stream messages as a 3.0 producer with flow control does
        (v3.0.0 src/upr-producer.cc ``BufferLog::insert``): a message goes when
        nothing is outstanding or when it fits in what the buffer has left, else
        it waits for a BUFFER_ACKNOWLEDGEMENT."""
        upr = self.upr
        for message in data:
            while upr.outstanding and upr.outstanding + len(message) > upr.buffer_size:
                await upr.wait_for_frame()
            upr.outstanding += len(message)
            await self.send(message)


@dataclass
class ScriptedUpr:
    play: Play
    vbuckets: dict[int, tuple[int, int]] = field(default_factory=lambda: {0: (0xABC, 100)})
    """Each vbucket's (uuid, high seqno), as STAT vbucket-seqno reports them."""
    requests: list[Request] = field(default_factory=list)
    received: list[Reply] = field(default_factory=list)
    """Every frame a consumer sent after its OPEN and CONTROLs were answered."""
    buffer_size: int = 0
    """The consumer's CONTROL connection_buffer_size (0: none)."""
    controls: dict[bytes, bytes] = field(default_factory=dict)
    """Every CONTROL the consumer sent, key to value (the last one of each key)."""
    outstanding: int = 0
    """Counted bytes ``send_counted`` sent that no BUFFER_ACKNOWLEDGEMENT returned yet."""
    refused_controls: dict[bytes, int] = field(default_factory=dict)
    """CONTROL keys answered with the given status instead of success."""
    connections: int = 0
    """UPR connections opened (OPEN received)."""
    closed: int = 0
    """UPR connections the consumer closed."""
    _arrived: trio.Event = field(default_factory=trio.Event)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        channel = Channel(stream, self)
        buffer = bytearray()
        upr = False
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    buffer += data
                    while (got := _take(buffer)) is not None:
                        upr = await self._on_frame(channel, got, nursery) or upr
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                if upr:
                    self.closed += 1
                nursery.cancel_scope.cancel()

    async def _on_frame(self, channel: Channel, got: Reply, nursery: trio.Nursery) -> bool:
        if got.magic == REQ and got.opcode == STAT:
            await channel.send(*self._stats(got), frame(STAT, magic=RES, opaque=got.opaque))
            return False
        if got.magic == REQ and got.opcode == OPEN:
            self.connections += 1
            await channel.send(frame(OPEN, magic=RES, opaque=got.opaque))
            return True
        if got.magic == REQ and got.opcode == CONTROL:
            self.controls[got.key] = got.value
            status = self.refused_controls.get(got.key, 0)
            if got.key == b"connection_buffer_size" and not status:
                self.buffer_size = int(got.value)
            await channel.send(frame(CONTROL, magic=RES, vbucket=status, opaque=got.opaque))
            return False
        self.received.append(got)
        if got.magic == REQ and got.opcode == BUFFER_ACK:
            # ``BufferLog::free``: clamps at zero, no answer
            self.outstanding = max(0, self.outstanding - struct.unpack(">I", got.extras)[0])
        self._arrived.set()
        self._arrived = trio.Event()
        if got.magic == REQ and got.opcode == STREAM_REQ:
            flags, _, start, end, uuid, snap_start, snap_end = struct.unpack(">IIQQQQQ", got.extras)
            request = Request(got.status, got.opaque, flags, start, end, uuid, snap_start, snap_end)
            self.requests.append(request)
            nursery.start_soon(self.play, channel, request)
        return False

    def _stats(self, got: Reply) -> list[bytes]:
        pairs: list[tuple[str, str]] = []
        for vb, (uuid, high) in self.vbuckets.items():
            if got.key == b"vbucket":
                pairs.append((f"vb_{vb}", "active"))
            else:
                pairs += [(f"vb_{vb}:uuid", str(uuid)), (f"vb_{vb}:high_seqno", str(high))]
        return [
            frame(STAT, magic=RES, key=k.encode(), value=v.encode(), opaque=got.opaque)
            for k, v in pairs
        ]

    async def wait_for_frame(self) -> None:
        """Until the consumer sends the next frame."""
        await self._arrived.wait()

    def replies(self, opcode: int) -> list[Reply]:
        return [r for r in self.received if r.magic == RES and r.opcode == opcode]


def _take(buffer: bytearray) -> Reply | None:
    if len(buffer) < HEADER.size:
        return None
    magic, opcode, klen, elen, _, status, blen, opaque, _ = HEADER.unpack_from(buffer)
    if len(buffer) < HEADER.size + blen:
        return None
    body = bytes(buffer[HEADER.size : HEADER.size + blen])
    del buffer[: HEADER.size + blen]
    return Reply(
        magic, opcode, status, opaque, body[:elen], body[elen : elen + klen], body[elen + klen :]
    )
