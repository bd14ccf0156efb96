"""The TAP front's connection to an upstream UPR node, as a consumer of its streams.

``UprUpstream.connect`` dials a ``PacketConnection`` (``gateway.io``, the one
connection type), authenticates with SASL PLAIN when credentials are given,
and runs the consumer handshake (``adapters.upr.consumer_handshake``: OPEN a
producer connection named after the TAP client, and in the released dialect
announce a flow-control buffer and ask for NOOPs; the draft has neither).
After that the session drives it: it sends STREAM_REQs and responses with
``send``, adds each socket read to the connection's ``reader`` with
``receive`` (the session translates what one read brought as one batch:
runs of items in place from ``reader.buffer``, anything else frame by frame
with ``next_frame``), and returns freed buffer bytes with ``acknowledge``.

Errors: ``UprUpstreamError`` for anything that makes the connection unusable
(refused, closed, a failed OPEN), so the session can reconnect;
``UprUpstreamMalformed`` for what the session must not retry.
"""

from __future__ import annotations

import logging
import ssl

import trio

from adapters import upr
from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import Frame
from adapters.upr.consumer_handshake import ConsumerHandshake, HandshakeRefused
from adapters.upr.flow_control import ConsumerWindow
from gateway.io.connection import ConnectionLost, PacketConnection, RequestFailed

log = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 8 * 1024 * 1024
DEFAULT_NOOP_INTERVAL = 120
HANDSHAKE_TIMEOUT = 10.0
ACK_FRACTION = 5
"""A BUFFER_ACKNOWLEDGEMENT returns at least 1/``ACK_FRACTION`` of the buffer."""
_LOST = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ConnectionLost)


class UprUpstreamError(GatewayError):
    """The upstream connection failed or closed; a reconnect may help."""


class UprUpstreamMalformed(GatewayError):
    """The upstream sent what no 3.0 producer sends (an unknown opcode, a wrong
    extras length, a message for no stream of ours): a reconnect would replay it,
    so the upstream connection and the TAP peer's are closed."""


class UprUpstream:
    def __init__(self, conn: PacketConnection, address: str, dialect: upr.Dialect) -> None:
        self.conn = conn
        self.reader = conn.reader
        """Bytes received and not yet taken as frames: the session's fast path reads
        whole runs of items in place, the rest goes through ``next_frame``."""
        self.address = address
        self.dialect = dialect
        self._opaques = 0
        self.window = ConsumerWindow()
        """Counted bytes received and not yet acknowledged, and the buffer announced."""
        self._freed = 0
        """Bytes the TAP peer's acks freed that no BUFFER_ACKNOWLEDGEMENT returned yet."""

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
            conn = await PacketConnection.connect(
                host, port, name=f"UPR upstream {address}", ssl_context=ssl_context
            )
        except OSError as exc:
            raise UprUpstreamError(f"cannot connect to UPR upstream {address}: {exc}") from None
        self = cls(conn, address, dialect)
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
        conn = self.conn
        if user is not None:
            await conn.sasl_plain(user, password or "")
        handshake = ConsumerHandshake(
            self.dialect, name, buffer_size=buffer_size, noop_interval=noop_interval
        )
        while (request := handshake.next_request()) is not None:
            await self.send(request)
            # Nothing else flows before the answer.
            while not handshake.receive(upr.decode_frame(await conn.next_frame(), self.dialect)):
                pass
        self.window.buffer_size = handshake.buffer_size
        self._opaques = handshake.opaque

    def next_opaque(self) -> int:
        self._opaques = (self._opaques + 1) & 0xFFFFFFFF
        return self._opaques

    async def send(self, data: bytes) -> None:
        try:
            await self.conn.send(data)
        except _LOST as exc:
            raise UprUpstreamError(f"UPR upstream {self.address}: send failed: {exc!r}") from None

    async def send_event(self, event: upr.UprEvent) -> None:
        await self.send(upr.encode(event, self.dialect))

    async def receive(self) -> None:
        """Add the next socket read to ``reader``."""
        try:
            received = await self.conn.receive_data()
        except _LOST as exc:
            raise UprUpstreamError(f"UPR upstream {self.address}: {exc!r}") from None
        if not received:
            raise UprUpstreamError(f"UPR upstream {self.address} closed the connection")

    def next_frame(self) -> Frame | None:
        """The next whole frame received, if any."""
        return self.reader.next_frame()

    async def acknowledge(self, size: int) -> None:
        """Return ``size`` freed bytes to the producer's flow-control window, in one
        BUFFER_ACKNOWLEDGEMENT once a fifth of the buffer is free, as a 3.0
        consumer does (ep-engine dcp/flow-control.cc: "a buffer ack when at least
        20% of the buffer is drained"), not one per TAP ack; and at once when the
        TAP peer freed everything received. A 3.0 producer holds a message that
        does not fit in what is left of the buffer (upr-producer.cc
        ``BufferLog::insert``): a message larger than four fifths of it would
        otherwise wait forever on bytes held back here (3.0's consumer also
        acks on a timer, ``UprConsumer::handleFlowCtl``)."""
        self._freed += size
        window = self.window
        if self._freed < window.buffer_size // ACK_FRACTION and self._freed < window.unacked_bytes:
            return
        size = self.window.release(self._freed)
        self._freed = 0
        if size:
            await self.send_event(upr.BufferAcknowledgement(size, opaque=self.next_opaque()))

    async def aclose(self) -> None:
        await self.conn.aclose()
