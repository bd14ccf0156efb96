"""What every UPR producer connection here does alike: the node's and the UPR front's.

Theory of operation. ``UprProducerBase.run`` reads the consumer's requests in
order and answers each at once: CONTROL (``connection_buffer_size``,
``enable_noop``, ``set_noop_interval``, ``enable_expiry_opcode`` (only on a
connection opened with include-delete-times); known keys we do not implement,
such as ``stream_buffer_size``, are NOT_SUPPORTED, any other key
INVALID_ARGUMENTS), BUFFER_ACKNOWLEDGEMENT (credited to the flow-control
``window``, waking every stream blocked on it; never answered, and more than
is outstanding just empties it), NOOP, and the
responses a producer waits for (NOOP, SET_VBUCKET_STATE, acked snapshot
markers), which go to the stream with that opaque. A NOOP task sends one
NOOP per interval once enabled and drops the connection when the previous
one is still unanswered. A request whose opcode is not UPR's (STAT,
VERSION, memcached's NOOP 0x0a, SASL, an opcode nobody knows) goes to the
listener's command door (``answer``), as memcached 3.0 runs every packet of
a UPR connection through its command dispatcher (daemon/memcached.c
``conn_ship_log``, ``process_bin_packet``): answered between stream
messages, UNKNOWN_COMMAND for an unknown opcode, and the stream goes on. A
malformed UPR request gets an error naming what was wrong and the
connection closes (``ProtocolError``).

Subclasses own their streams: ``_stream_request``, ``_failover_log`` and
``_close_stream``, plus hooks for what they also track (``_on_decode_error``,
``_on_buffer_size``, ``_on_expiry_opcode``, ``_on_acknowledged``).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, Status
from adapters.upr.flow_control import ProducerWindow
from gateway.io.door import Answer, refuse_command
from gateway.io.replies import error_reply
from gateway.wire import PacketConnection

log = logging.getLogger(__name__)

OK = Status.SUCCESS.value
_TRUE_FALSE = {b"true": True, b"false": False}
NOT_SUPPORTED_CONTROLS = frozenset(
    {
        b"stream_buffer_size",
        b"set_priority",
        b"enable_ext_metadata",
        b"enable_value_compression",
        b"supports_cursor_dropping",
    }
)
"""CONTROL keys a producer knows but does not implement: NOT_SUPPORTED (0x83),
as 3.0 answers stream_buffer_size; any other unknown key is EINVAL (0x04)."""


class AnsweringStream(Protocol):
    opaque: int

    @property
    def live(self) -> bool: ...

    def on_response(self, event: Any) -> None: ...


def parse_uint32(value: bytes) -> int | None:
    """A CONTROL number as ep-engine 3.0's ``parseUint32`` (src/utility.cc) reads it:
    ``strtoul`` base 10, so leading blanks and a ``+`` are fine and the number may
    be followed by a blank and anything; a ``-`` or a value over 32 bits is not."""
    text = value.lstrip(b" \t\n\r\v\f")
    if text[:1] == b"+":
        text = text[1:]
    digits = len(text) - len(text.lstrip(b"0123456789"))
    if not digits or (digits < len(text) and not text[digits : digits + 1].isspace()):
        return None
    number = int(text[:digits])
    return number if number <= 0xFFFFFFFF else None


def seconds(value: bytes) -> float | None:
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if 0 < parsed < float("inf") else None


class UprProducerBase:
    streams: dict[int, Any]
    """By vbucket: the subclass's streams (each with ``opaque``, ``live``, ``on_response``)."""

    def __init__(
        self,
        conn: PacketConnection,
        name: str,
        dialect: upr.Dialect,
        noop_interval: float,
        *,
        delete_times: bool = False,
        answer: Answer = refuse_command,
    ) -> None:
        self.conn = conn
        self.answer = answer
        """Answers the requests that are not UPR's (the listener's ``Door.answer``)."""
        self.name = name
        self.dialect = dialect
        self.window = ProducerWindow()
        self._room = trio.Event()
        self.expiry_opcode = False
        self.delete_times = delete_times
        """OPEN flag INCLUDE_DELETE_TIMES (0x20)."""
        self.noop_enabled = False
        self.noop_interval = noop_interval
        self._noop_changed = trio.Event()
        self._noop_outstanding: int | None = None
        self._opaques = itertools.count(1)
        self._nursery: trio.Nursery | None = None

    # -- running ---------------------------------------------------------------

    async def run(self, first: upr.UprEvent | None) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._noop_loop)
            if first is not None:
                await self.handle(first)
            conn, upr_opcodes = self.conn, self.dialect.commands
            while (frame := await conn.receive_frame()) is not None:
                if frame.magic == Magic.REQUEST and frame.opcode not in upr_opcodes:
                    await self.answer(conn, frame)  # memcached's own commands
                else:
                    await self.handle(await self._decode(frame))
            # The consumer went away: nobody is left to stream to.
            nursery.cancel_scope.cancel()

    async def _decode(self, frame: Frame) -> upr.UprEvent:
        try:
            return upr.decode_frame(frame, self.dialect)
        except ProtocolError as exc:
            self._on_decode_error(exc)
            if frame.magic == Magic.REQUEST:
                status = exc.status or Status.INVALID_ARGUMENTS
                self.conn.send_nowait(error_reply(frame, status, str(exc)))
            raise

    async def handle(self, event: upr.UprEvent) -> None:
        if event.IS_RESPONSE:
            self._on_response(event)  # type: ignore[arg-type]
        elif isinstance(event, upr.StreamRequest):
            authority = self.conn.authority
            if (
                event.flags & upr.StreamFlags.TAKEOVER
                and authority is not None
                and not authority.may_administer()
            ):
                denied = authority.refuse_admin("UPR takeover stream")
                await self._refuse(event, Status.NO_ACCESS, denied)
            else:
                await self._stream_request(event)
        elif isinstance(event, upr.Control):
            await self._control(event)
        elif isinstance(event, upr.BufferAcknowledgement):
            await self._buffer_ack(event)
        elif isinstance(event, upr.CloseStream):
            await self._close_stream(event)
        elif isinstance(event, upr.GetFailoverLog):
            await self._failover_log(event)
        elif isinstance(event, upr.Noop):
            await self.respond(upr.Response(upr.Command.NOOP, event.opaque, OK))
        else:
            await self._refuse(event, Status.NOT_SUPPORTED, f"{event.NAME} is not for a producer")

    # -- what subclasses provide -----------------------------------------------

    async def _stream_request(self, req: upr.StreamRequest) -> None:
        raise NotImplementedError

    async def _failover_log(self, req: upr.GetFailoverLog) -> None:
        raise NotImplementedError

    async def _close_stream(self, req: upr.CloseStream) -> None:
        raise NotImplementedError

    def _on_decode_error(self, exc: ProtocolError) -> None:
        """A request did not decode (counted by subclasses that keep statistics)."""

    def _on_buffer_size(self, size: int) -> None:
        """CONTROL connection_buffer_size was applied."""

    def _on_expiry_opcode(self, enabled: bool) -> None:
        """CONTROL enable_expiry_opcode was applied."""

    def _on_acknowledged(self) -> None:
        """A BUFFER_ACKNOWLEDGEMENT was credited to the window."""

    # -- sending ---------------------------------------------------------------

    async def respond(self, event: upr.UprEvent) -> None:
        await self.conn.send(upr.encode(event, self.dialect))

    async def _refuse(self, event: upr.UprEvent, status: int, text: str) -> None:
        command = getattr(event, "COMMAND", upr.Command.OPEN)
        await self.respond(upr.Response(command, event.opaque, status, text.encode()))

    # -- flow control and settings ---------------------------------------------

    async def _buffer_ack(self, ack: upr.BufferAcknowledgement) -> None:
        # memcached 3.0 never answers a buffer ack (upr-producer.cc
        # ``bufferAcknowledgement`` returns success, and success is silent).
        if not self.window.enabled:
            return  # nothing was counted, so there is nothing to credit
        self.window.acknowledged(ack.buffer_bytes)
        self._on_acknowledged()
        self._room.set()

    async def _control(self, req: upr.Control) -> None:
        key = req.key
        if key in NOT_SUPPORTED_CONTROLS:
            # upr-producer.cc ``control``: stream_buffer_size is ENGINE_ENOTSUP.
            text = f"control key {key.decode()!r} is not supported by this producer"
            await self._refuse(req, Status.NOT_SUPPORTED, text)
            return
        error = self._apply_control(key, req.value.rstrip(b"\x00"))
        if error is None:
            await self.respond(upr.Response(upr.Command.CONTROL, req.opaque, OK))
        else:
            await self._refuse(req, Status.INVALID_ARGUMENTS, error)

    def _apply_control(self, key: bytes, value: bytes) -> str | None:
        """Apply one CONTROL setting; the error text if it is refused (EINVAL)."""
        shown = value.decode("utf-8", "replace")
        if key == b"enable_expiry_opcode" and value == b"true" and not self.delete_times:
            # Servers that know the expiry opcode send EXPIRATION only in the
            # delete-time layout, so they refuse it on a connection without
            # OPEN flag 0x20 (kv_engine dcp/producer.cc ``control``).
            return "enable_expiry_opcode needs a connection opened with include-delete-times (0x20)"
        if key == b"connection_buffer_size":
            size = parse_uint32(value)
            if size is None:
                return f"connection_buffer_size must be a 32-bit decimal number, not {shown!r}"
            self.window.set_buffer_size(size)
            self._on_buffer_size(size)
            self._room.set()
        elif key == b"enable_noop":
            # ep-engine 3.0 dcp-producer.cc ``control``: "true" turns NOOPs on,
            # any other value turns them off; neither is refused.
            self.noop_enabled = value == b"true"
            self._noop_changed.set()
        elif key == b"enable_expiry_opcode":
            flag = _TRUE_FALSE.get(value)
            if flag is None:
                return f"enable_expiry_opcode must be true or false, not {shown!r}"
            self.expiry_opcode = flag
            self._on_expiry_opcode(flag)
        elif key == b"set_noop_interval":
            interval = seconds(value)
            if interval is None:
                return f"set_noop_interval must be a positive number of seconds, not {shown!r}"
            self.noop_interval = interval
            self._noop_changed.set()
        else:
            return f"unknown control key {key.decode('utf-8', 'replace')!r}"
        return None

    # -- responses from the consumer -------------------------------------------

    def _on_response(self, event: upr.UprResponse) -> None:
        command = getattr(event, "command", None)
        if command is upr.Command.NOOP:
            if event.opaque == self._noop_outstanding:
                self._noop_outstanding = None
            return
        if command in (upr.Command.SET_VBUCKET_STATE, upr.Command.SNAPSHOT_MARKER):
            for stream in self.streams.values():
                if stream.opaque == event.opaque and stream.live:
                    stream.on_response(event)
                    return
        log.debug("%s: ignoring unexpected response %r", self.name, event)

    # -- NOOP ------------------------------------------------------------------

    async def _noop_loop(self) -> None:
        while True:
            self._noop_changed = trio.Event()
            if not self.noop_enabled:
                await self._noop_changed.wait()
                continue
            with trio.move_on_after(self.noop_interval):
                await self._noop_changed.wait()
                continue  # settings changed: start the interval again
            if self._noop_outstanding is not None:
                raise ProtocolError(
                    f"consumer {self.name!r} did not answer a NOOP within "
                    f"{self.noop_interval:g} seconds"
                )
            self._noop_outstanding = next(self._opaques)
            await self.respond(upr.Noop(opaque=self._noop_outstanding))
