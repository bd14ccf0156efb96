"""The TAP front's connection to an upstream UPR node, as a consumer of its streams.

``UprUpstream.connect`` opens the socket, authenticates with SASL PLAIN when
credentials are given, OPENs a producer connection named after the TAP
client, and in the released dialect announces a flow-control buffer and asks
for NOOPs (the draft has neither). After that the session drives it: it
sends STREAM_REQs and responses with ``send``, adds each socket read to
``buffer`` with ``receive`` (the session translates what one read brought
as one batch: runs of items straight from ``buffer``, anything else frame
by frame with ``next_frame``), and returns freed buffer bytes with
``acknowledge``.

Errors: ``UprUpstreamError`` for anything that makes the connection unusable
(refused, closed, a failed OPEN), so the session can reconnect; malformed
frames raise the codec's ``ProtocolError``.
"""

from __future__ import annotations

import logging
import ssl

import trio

from adapters import upr
from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE, HEADER_SIZE, Frame, Magic
from adapters.mcbp.frames import HEADER
from adapters.upr.consumer_handshake import ConsumerHandshake, HandshakeRefused
from adapters.upr.flow_control import ConsumerWindow
from gateway.io.connection import PacketConnection as McbpClient
from gateway.io.connection import RequestFailed
from gateway.io.tls import open_stream

log = logging.getLogger(__name__)

RECEIVE_SIZE = 256 * 1024
DEFAULT_BUFFER_SIZE = 8 * 1024 * 1024
DEFAULT_NOOP_INTERVAL = 120
HANDSHAKE_TIMEOUT = 10.0
ACK_FRACTION = 5
"""A BUFFER_ACKNOWLEDGEMENT returns at least 1/``ACK_FRACTION`` of the buffer."""


class UprUpstreamError(GatewayError):
    """The upstream connection failed or closed; a reconnect may help."""


class UprUpstream:
    def __init__(self, stream: trio.abc.Stream, address: str, dialect: upr.Dialect) -> None:
        self.stream = stream
        self.address = address
        self.dialect = dialect
        self.buffer = bytearray()
        """Bytes received and not yet taken as frames, from ``offset`` on: the session's
        fast path reads whole runs of items here, the rest goes through ``next_frame``."""
        self.offset = 0
        self.max_frame_size = DEFAULT_MAX_FRAME_SIZE
        self._send_lock = trio.Lock()
        self._opaques = 0
        self.window = ConsumerWindow()
        """Counted bytes received and not yet acknowledged, and the buffer announced."""
        self._freed = 0
        """Bytes the TAP peer's acks freed that no BUFFER_ACKNOWLEDGEMENT returned yet."""
        self.bytes_received = 0

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        name: bytes,
        dialect: upr.Dialect = upr.DCP,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        noop_interval: int = DEFAULT_NOOP_INTERVAL,
        user: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> UprUpstream:
        address = f"{host}:{port}"
        try:
            stream = await open_stream(host, port, ssl_context)
        except OSError as exc:
            raise UprUpstreamError(f"cannot connect to UPR upstream {address}: {exc}") from None
        self = cls(stream, address, dialect)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await self._handshake(name, buffer_size, noop_interval, user, password)
        except (trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
            await self.aclose()
            raise UprUpstreamError(f"UPR upstream {address}: handshake failed: {exc!r}") from None
        except (UprUpstreamError, ProtocolError, RequestFailed, HandshakeRefused) as exc:
            await self.aclose()
            raise UprUpstreamError(f"UPR upstream {address}: {exc}") from None
        return self

    async def _handshake(
        self,
        name: bytes,
        buffer_size: int,
        noop_interval: int,
        user: str | None,
        password: str | None,
    ) -> None:
        if user is not None:
            client = McbpClient(self.stream, name=f"upstream {self.address}")
            await client.sasl_plain(user, password or "")
        handshake = ConsumerHandshake(
            self.dialect, name, buffer_size=buffer_size, noop_interval=noop_interval
        )
        while (request := handshake.next_request()) is not None:
            await self.send(request)
            answered = False
            while not answered:
                for frame in await self.receive_batch():
                    # Nothing else flows before the answer.
                    answered = handshake.receive(upr.decode_frame(frame, self.dialect))
                    if answered:
                        break
        self.window.buffer_size = handshake.buffer_size
        self._opaques = handshake.opaque

    def next_opaque(self) -> int:
        self._opaques = (self._opaques + 1) & 0xFFFFFFFF
        return self._opaques

    async def send(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UprUpstreamError(f"UPR upstream {self.address}: send failed: {exc!r}") from None

    async def send_event(self, event: upr.UprEvent) -> None:
        await self.send(upr.encode(event, self.dialect))

    async def receive_batch(self) -> list[Frame]:
        """Every complete frame of the next socket read (waits for at least one)."""
        frames: list[Frame] = []
        while not frames:
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
            if frames:
                break
            await self.receive()
        return frames

    async def receive(self) -> None:
        """Add the next socket read to ``buffer``."""
        try:
            data = await self.stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UprUpstreamError(f"UPR upstream {self.address}: {exc!r}") from None
        if not data:
            raise UprUpstreamError(f"UPR upstream {self.address} closed the connection")
        self.bytes_received += len(data)
        if self.offset:
            # Drop what was taken before growing: at most one partial frame stays.
            del self.buffer[: self.offset]
            self.offset = 0
        self.buffer += data

    def next_frame(self) -> Frame | None:
        """The frame at ``offset``, if whole, as ``FrameReader.next_frame`` reads it."""
        buf, offset = self.buffer, self.offset
        if len(buf) - offset < HEADER_SIZE:
            return None
        magic, opcode, keylen, extlen, datatype, vbs, bodylen, opaque, cas = HEADER.unpack_from(
            buf, offset
        )
        if magic != Magic.REQUEST and magic != Magic.RESPONSE:
            raise ProtocolError("bad magic byte", opcode=opcode, field="magic", value=magic)
        if bodylen > self.max_frame_size:
            raise ProtocolError(
                f"declared body exceeds the {self.max_frame_size}-byte frame limit",
                opcode=opcode,
                field="total_body",
                value=bodylen,
            )
        if extlen + keylen > bodylen:
            raise ProtocolError(
                "extras and key are longer than the total body",
                opcode=opcode,
                field="total_body",
                value=bodylen,
            )
        end = offset + HEADER_SIZE + bodylen
        if len(buf) < end:
            return None
        self.offset = end
        body = bytes(buf[offset + HEADER_SIZE : end])
        return Frame(magic, opcode, keylen, extlen, datatype, vbs, opaque, cas, body)

    async def acknowledge(self, size: int) -> None:
        """Return ``size`` freed bytes to the producer's flow-control window, in one
        BUFFER_ACKNOWLEDGEMENT once a fifth of the buffer is free, as a 3.0
        consumer does (ep-engine dcp/flow-control.cc: "a buffer ack when at least
        20% of the buffer is drained"), not one per TAP ack. The producer never
        stalls on what is held back: it stops only with the whole buffer unacked,
        and then every byte the TAP peer acks is freed here."""
        self._freed += size
        if self._freed < self.window.buffer_size // ACK_FRACTION:
            return
        size = self.window.release(self._freed)
        self._freed = 0
        if size:
            await self.send_event(upr.BufferAcknowledgement(size, opaque=self.next_opaque()))

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()
