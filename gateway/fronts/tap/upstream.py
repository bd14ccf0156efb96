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

Keeping the connection alive while the pump is away. A 3.0 producer with
NOOPs on (ep-engine 3.0 upr-producer.cc ``maybeSendNoop``) sends one every
``noop_interval`` seconds whatever else flows, and drops the connection when
the previous one is still unanswered at the next. The pump answers NOOPs
as it meets them, but while it waits on its TAP peer (a full ack window, a
full outbox) it reads nothing, and a NOOP may sit behind a flow-control
buffer's worth of items. ``keep_alive`` (a task per connection, with
``pump_away`` marking the pump's waits) answers them meanwhile:

- it reads only while the pump is away, and never at the same time as the
  pump: ``receive`` adopts a read the keeper has in progress instead of
  starting a second one (so no read is ever cancelled half way, which TLS
  does not survive, and no bytes are read twice);
- what it reads goes into ``reader`` after what is there, as the pump's own
  reads do: nothing is consumed, items stay for the pump in order. A read
  compacts the buffer (``FrameReader.receive_data`` drops what was consumed),
  which is safe because the pump holds no position in it across an await:
  the fast path takes a run of frames from ``reader.offset`` and advances
  it before its next await, and the event path copies each frame out;
- memory stays bounded by what the producer may send: a 3.0 producer stops
  at the flow-control buffer (only the TAP peer's acks return it), and NOOPs
  and replies are small; the keeper stops reading past the buffer plus one
  largest frame, should a producer not stop;
- it scans the unconsumed bytes once each, frame header by frame header,
  answers every NOOP request it finds, and records how far it answered
  (``noops_answered_to``, a stream offset): the pump, meeting those NOOPs
  later, does not answer them again.

Only a connection with flow control and NOOPs (the released dialect) has a
keeper; the draft has neither, and an upstream that refuses ``enable_noop``
sends none (the session goes on without them, as a 3.0 consumer does).

Errors: ``UprUpstreamError`` for anything that makes the connection unusable
(refused, closed, a failed OPEN), so the session can reconnect;
``UprUpstreamMalformed`` for what the session must not retry.
"""

from __future__ import annotations

import logging
import ssl
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from adapters import upr
from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import HEADER_SIZE, Frame, Magic, Status
from adapters.upr.consumer_handshake import ConsumerHandshake, HandshakeRefused
from adapters.upr.flow_control import ConsumerWindow
from gateway.io.connection import ConnectionLost, PacketConnection, RequestFailed
from gateway.runtime.logs import describe

log = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 8 * 1024 * 1024
DEFAULT_NOOP_INTERVAL = 120
HANDSHAKE_TIMEOUT = 10.0
ACK_FRACTION = 5
"""A BUFFER_ACKNOWLEDGEMENT returns at least 1/``ACK_FRACTION`` of the buffer."""
_LOST = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ConnectionLost)
_HEAD = struct.Struct(">BB6xII")
"""Magic, opcode, body length and opaque of a frame header."""
_REQUEST = Magic.REQUEST.value
_OK = Status.SUCCESS.value
_RESPONSE = Magic.RESPONSE.value


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
        self.noops = True
        """The upstream sends NOOPs: false once the handshake found ``enable_noop``
        refused (or not asked, as in the draft dialect)."""
        self.noops_answered_to = 0
        """Every NOOP request before this stream offset was answered by the keeper."""
        self.noops_kept = 0
        """NOOPs the keeper answered while the pump was away."""
        self._reading = False
        """A socket read is in progress (the pump's or the keeper's)."""
        self._unseen = False
        """A read brought bytes the pump has not looked at yet (the keeper's, while
        the pump was away after its last look)."""
        self._read_done: trio.Event | None = None
        """Set when the read in progress ends (made by whoever waits for it)."""
        self._failure: UprUpstreamError | None = None
        """Why the connection is unusable, once a read found out."""
        self._away = 0
        """The pump waits on its TAP peer (nested waits count)."""
        self._keeper_wake: trio.Event | None = None
        self._keeper_scope = trio.CancelScope()

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
            raise UprUpstreamError(
                f"cannot connect to UPR upstream {address}: {describe(exc, host)}"
            ) from None
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
        self.noops = handshake.noops
        if handshake.granted.get("CONTROL enable_noop") is False:
            log.warning(
                "UPR upstream %s refused CONTROL enable_noop; going on without its NOOPs, "
                "as a 3.0 consumer does (a dead upstream is seen when its connection closes)",
                self.address,
            )

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
        """Add the next socket read to ``reader`` (the pump's read): at once when the
        keeper read something the pump has not seen yet, and a read the keeper has
        in progress is taken over rather than doubled. A failed read raises once
        what came before it was seen."""
        if not self._unseen:
            if self._failure is None:
                if self._reading:
                    if self._read_done is None:
                        self._read_done = trio.Event()
                    await self._read_done.wait()
                else:
                    await self._read()
            if not self._unseen and self._failure is not None:
                raise self._failure
        self._unseen = False

    async def _read(self) -> None:
        self._reading = True
        try:
            received = await self.conn.receive_data()
        except _LOST as exc:
            self._failure = UprUpstreamError(f"UPR upstream {self.address}: {exc!r}")
            return
        finally:
            self._reading = False
            done = self._read_done
            if done is not None:
                self._read_done = None
                done.set()
        if received:
            self._unseen = True
        else:
            self._failure = UprUpstreamError(f"UPR upstream {self.address} closed the connection")

    # -- answering NOOPs while the pump is away ---------------------------------

    @property
    def keeps_alive(self) -> bool:
        """Whether the connection has flow control and NOOPs (see the module docstring)."""
        return self.window.buffer_size > 0 and self.noops

    @contextmanager
    def pump_away(self) -> Iterator[None]:
        """The pump waits on its TAP peer for the block: the keeper may read."""
        self._away += 1
        wake = self._keeper_wake
        if wake is not None:
            wake.set()
        try:
            yield
        finally:
            self._away -= 1

    async def keep_alive(self) -> None:
        """Answer the upstream's NOOPs while the pump is away (the module docstring
        says how); ends with the connection (``aclose``) or at a failed read, which
        the pump's next ``receive`` raises."""
        if not self.keeps_alive:
            return
        limit = self.window.buffer_size + HEADER_SIZE + self.reader.max_frame_size
        with self._keeper_scope:
            while self._failure is None:
                if self._away:
                    await self._answer_buffered_noops()
                if not self._away or self.reader.buffered >= limit:
                    # Until the pump next goes away (past the limit: the producer
                    # did not stop at its buffer; what is read stays unread).
                    self._keeper_wake = wake = trio.Event()
                    await wake.wait()
                    self._keeper_wake = None
                elif self._reading:  # (only ever the keeper's own: the pump is away)
                    if self._read_done is None:
                        self._read_done = trio.Event()
                    await self._read_done.wait()
                else:
                    await self._read()

    async def _answer_buffered_noops(self) -> None:
        opaques = self.take_buffered_noops()
        if not opaques:
            return
        dialect = self.dialect
        replies = b"".join(
            upr.encode(upr.Response(upr.Command.NOOP, opaque, _OK), dialect) for opaque in opaques
        )
        self.noops_kept += len(opaques)
        try:
            await self.send(replies)
        except UprUpstreamError as exc:
            self._failure = exc

    def take_buffered_noops(self) -> list[int]:
        """The opaques of the NOOP requests among the whole frames not consumed and
        not scanned yet; moves ``noops_answered_to`` past them."""
        reader = self.reader
        buf = reader.buffer
        base = reader.consumed - reader.offset  # the stream offset of buf[0]
        at = max(reader.offset, self.noops_answered_to - base)
        end = len(buf)
        noop = self.dialect.opcodes[upr.Command.NOOP]
        most = reader.max_frame_size
        opaques = []
        while end - at >= HEADER_SIZE:
            magic, opcode, body, opaque = _HEAD.unpack_from(buf, at)
            if (magic != _REQUEST and magic != _RESPONSE) or body > most:
                break  # the pump reports it when it gets there
            if at + HEADER_SIZE + body > end:
                break
            if magic == _REQUEST and opcode == noop:
                opaques.append(opaque)
            at += HEADER_SIZE + body
        self.noops_answered_to = base + at
        return opaques

    def answered(self, frame: Frame) -> bool:
        """Whether the keeper answered ``frame``, a NOOP the pump just took."""
        return self.reader.consumed - frame.size < self.noops_answered_to

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
        self._keeper_scope.cancel()
        await self.conn.aclose()
