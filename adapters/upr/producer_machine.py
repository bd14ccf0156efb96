"""A UPR producer connection without I/O: CONTROL, flow control, NOOPs, the stream table.

Theory of operation. ``ProducerMachine`` holds what one producer connection
decides, the way h11 holds an HTTP connection: the I/O side hands it each
frame the consumer sent (``receive_frame``) and the time, and acts on what
comes back, in order; it asks ``next_deadline()`` when to call ``on_timer``;
it sends stream messages itself, within ``window``. Nothing here waits,
reads a clock or touches a socket.

What comes back (``Output``), one class per thing the I/O side does:

==================  ==========================================================
``Reply``           bytes to queue for the consumer now
``McCommand``       a request that is not UPR's: the listener's command door
                    answers it (STAT, VERSION, NOOP 0x0a, an unknown opcode:
                    memcached 3.0 ``conn_ship_log`` dispatches them as on any
                    connection), and the stream goes on
``StreamWanted``    a STREAM_REQ that passed the connection's checks: the
                    role (node or front) answers it from its data and, when
                    it starts the stream, calls ``add_stream``
``LogWanted``       a GET_FAILOVER_LOG: the role answers from its data
``EndStream``       CLOSE_STREAM of a live stream: make it dead before the
                    ``Reply`` that follows, so nothing of it follows the answer
``Deliver``         a reply a stream waits for (SET_VBUCKET_STATE, an acked
                    snapshot marker), with that stream
``Applied``         a CONTROL setting took effect (``key``, ``value``)
``Room``            the window may have room again: wake the blocked streams
``Fail``            a malformed frame: its error ``Reply`` came first; close
==================  ==========================================================

Requests, by event class (``_REQUESTS``, the one transition table):

- STREAM_REQ: a takeover stream from a user who may not administer is
  NO_ACCESS; a vbucket the role does not serve NOT_MY_VBUCKET; one receiving
  its initial backfill (``backfilling``) TMPFAIL; a vbucket with a live
  stream on this connection RANGE_ERROR for a bad range (the end LATEST or
  DISKONLY ask for is the role's ``high_seqno`` now), else
  KEY_EXISTS (ep-engine 3.0 ``UprProducer::streamRequest``); else
  ``StreamWanted``. A notifier connection (``notifier``, OPEN flag 0x02)
  has no range checks: only KEY_EXISTS.
- GET_FAILOVER_LOG: ``LogWanted``.
- CLOSE_STREAM: no live stream on the vbucket KEY_NOT_FOUND; else
  ``EndStream`` then OK (``closeStream`` drops the stream before its
  STREAM_END could go). Either way the stream leaves the table (and the
  stats), as 3.0 erases it.
- CONTROL: ``connection_buffer_size`` (``parse_uint32``), ``enable_noop``
  (``true`` on, anything else off), ``set_noop_interval`` (seconds),
  ``enable_expiry_opcode`` (``true``/``false``; true only on a connection
  opened with include-delete-times) are applied and answered OK; the keys a
  producer knows but we do not implement NOT_SUPPORTED; any other key or a
  bad value EINVAL. None closes the connection.
- BUFFER_ACKNOWLEDGEMENT: credited to the window (more than is outstanding
  empties it), never answered: ``Room``.
- A second OPEN, or a request only a consumer takes (ADD_STREAM, the
  stream messages, UPR's NOOP, ...): ``Fail`` without a reply (3.0
  ``dcpOpen`` and ``ConnHandler`` answer ENGINE_DISCONNECT, and memcached
  closes).

Responses (3.0 ``handleResponse``): NOOP's clears the NOOP outstanding when
it carries the last NOOP's opaque; SET_VBUCKET_STATE's and SNAPSHOT_MARKER's
go to the live stream with that opaque (``Deliver``), whatever their status;
MUTATION's, DELETION's, EXPIRATION's and STREAM_END's are dropped; any other
``Fail``.

NOOP liveness: once enabled, a NOOP is due ``noop_interval`` after the last
one (or after the setting changed); ``on_timer`` at the deadline returns the
NOOP's bytes, or raises ``ProtocolError`` when the previous one is still
unanswered, and the connection drops (ep-engine 3.0 upr-producer.cc ``UprProducer::maybeSendNoop``).

Flow control: ``window`` is the ``ProducerWindow`` the streams count their
writes in (once per write, on the hot path); ``flow_control.counts(event)``
tells which messages count, by event class.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, Status, error_response
from adapters.upr.codec import decode_frame, encode
from adapters.upr.constants import Command, StreamFlags
from adapters.upr.dialect import Dialect
from adapters.upr.events import (
    BufferAcknowledgement,
    CloseStream,
    Control,
    GetFailoverLog,
    Noop,
    Open,
    StreamRequest,
    UprEvent,
)
from adapters.upr.flow_control import ProducerWindow
from adapters.upr.responses import Response
from adapters.upr.rollback import range_refusal, resolve_end

OK = Status.SUCCESS.value
_REQUEST = Magic.REQUEST.value
_TRUE_FALSE = {b"true": True, b"false": False}
_RESOLVED_END = StreamFlags.LATEST | StreamFlags.DISK_ONLY
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


def parse_uint32(value: bytes) -> int | None:
    """A CONTROL number as ep-engine 3.x's ``parseUint32`` (src/utility.cc) reads it:
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


_KEYS_3_0 = (
    b"connection_buffer_size",
    b"stream_buffer_size",
    b"enable_noop",
    b"set_noop_interval",
)
"""The CONTROL keys 3.0 knows, in the order ``UprProducer::control`` tries them."""


def _strncmp_matches(key: bytes, literal: bytes) -> bool:
    """``strncmp(key, literal, len(key)) == 0``: ``key`` is a prefix of
    ``literal``, or ``literal`` followed by a NUL (and anything after it)."""
    terminated = literal + b"\x00"
    for i, byte in enumerate(key):
        if i >= len(terminated) or byte != terminated[i]:
            return False
        if byte == 0:
            return True
    return True


def control_key(key: bytes) -> bytes:
    """The key a CONTROL names. 3.0 compares the key it received with
    ``strncmp(key, known, nkey)``, so a key sent with its C string's NUL (or a
    prefix of a known key) names that key; keys of later servers match whole."""
    if key in _CONTROLS or key in NOT_SUPPORTED_CONTROLS:
        return key
    for known in _KEYS_3_0:
        if _strncmp_matches(key, known):
            return known
    return key


def seconds(value: bytes) -> float | None:
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if 0 < parsed < float("inf") else None


class Stream(Protocol):
    """What the machine needs of a stream the I/O side runs."""

    opaque: int

    @property
    def live(self) -> bool: ...


S = TypeVar("S", bound=Stream)


class Reply(NamedTuple):
    data: bytes


class McCommand(NamedTuple):
    frame: Frame


class StreamWanted(NamedTuple):
    request: StreamRequest


class LogWanted(NamedTuple):
    request: GetFailoverLog


class EndStream(NamedTuple):
    stream: Any


class Deliver(NamedTuple):
    stream: Any
    response: Any


class Applied(NamedTuple):
    key: bytes
    value: object


class Room(NamedTuple):
    pass


class Fail(NamedTuple):
    error: ProtocolError


Output = Reply | McCommand | StreamWanted | LogWanted | EndStream | Deliver | Applied | Room | Fail
ROOM: tuple[Output, ...] = (Room(),)
NOTHING: tuple[Output, ...] = ()


class ProducerMachine(Generic[S]):
    """One UPR producer connection's decisions (see the module docstring)."""

    def __init__(
        self,
        name: str,
        dialect: Dialect,
        *,
        noop_interval: float,
        delete_times: bool = False,
        serves: Callable[[int], bool] = lambda _vb: True,
        admission: Callable[[str], str | None] = lambda _what: None,
        notifier: bool = False,
        high_seqno: Callable[[int], int] | None = None,
        backfilling: Callable[[int], bool] = lambda _vb: False,
    ) -> None:
        self.name = name
        self.dialect = dialect
        self.window = ProducerWindow()
        self.streams: dict[int, S] = {}
        """By vbucket; an ended stream stays (for its stats) until replaced or closed."""
        self.delete_times = delete_times
        """OPEN flag INCLUDE_DELETE_TIMES (0x20)."""
        self.expiry_opcode = False
        self.noop_enabled = False
        self.noop_interval = noop_interval
        self.serves = serves
        """Whether the role serves a vbucket (else NOT_MY_VBUCKET)."""
        self.admission = admission
        """None when the user may administer, else the refusal's text (counted)."""
        self.notifier = notifier
        """OPEN flag NOTIFIER (0x02) alone: streams end once the vbucket passes their
        start, and carry no items (3.0 ``UprProducer`` with ``notifyOnly``)."""
        self.high_seqno = high_seqno
        """A served vbucket's high seqno now (None: unknown here, the role checks)."""
        self.backfilling = backfilling
        """Whether a served vbucket is receiving its initial backfill (3.0: its open
        checkpoint id is 0): TMPFAIL, for notifiers too, before any range check."""
        self._upr_opcodes = dialect.commands
        self._draft = Command.SNAPSHOT_MARKER not in dialect.opcodes
        self._noop_due: float | None = None
        self._noop_outstanding: int | None = None
        self._noop_last: int | None = None
        """The last NOOP's opaque: the one a NOOP reply may carry."""
        self._opaques = itertools.count(1)

    # -- input -------------------------------------------------------------------

    def receive_frame(self, frame: Frame, now: float) -> tuple[Output, ...]:
        """What to do about one frame from the consumer."""
        if frame.magic == _REQUEST and frame.opcode not in self._upr_opcodes:
            return (McCommand(frame),)
        try:
            event = decode_frame(frame, self.dialect)
        except ProtocolError as exc:
            if frame.magic != _REQUEST:
                return (Fail(exc),)
            return (Reply(error_response(frame, exc)), Fail(exc))
        return self.receive(event, now)

    def receive(self, event: UprEvent, now: float) -> tuple[Output, ...]:
        """What to do about one decoded event (a first request handed over too)."""
        if event.IS_RESPONSE:
            return self._response(event)
        transition = _REQUESTS.get(type(event))
        if transition is not None:
            return transition(self, event, now)
        # A consumer's message sent to a producer (3.0 ``ConnHandler``):
        # ENGINE_DISCONNECT, and memcached closes, no reply. A second OPEN:
        # 3.0.0's ``uprOpen`` put a second handler over the first; later 3.x
        # ``dcpOpen`` refuses it this way ("another connection exists on the
        # same socket"), and so do we.
        command: Command = getattr(event, "COMMAND", Command.OPEN)
        reason = (
            "OPEN on a connection open already"
            if isinstance(event, Open)
            else f"{event.NAME} is a request for a consumer, not a producer"
        )
        error = ProtocolError(
            reason,
            opcode=self.dialect.opcodes[command],
            field="opcode",
            value=self.dialect.opcodes[command],
            offset=1,
        )
        return (Fail(error),)

    # -- the stream table ------------------------------------------------------------

    def add_stream(self, vbucket: int, stream: S) -> None:
        """The role accepted a STREAM_REQ and runs ``stream`` for ``vbucket``."""
        self.streams[vbucket] = stream

    def _stream_request(self, req: StreamRequest, _now: float) -> tuple[Output, ...]:
        vb = req.vbucket
        if req.flags & StreamFlags.TAKEOVER:
            denied = self.admission("UPR takeover stream")
            if denied is not None:
                return self._refuse(req, Status.NO_ACCESS, denied)
        if not self.serves(vb):
            return self._refuse(req, Status.NOT_MY_VBUCKET, f"no vbucket {vb} here")
        if self.backfilling(vb):
            # 3.0 ``streamRequest``: "this vbucket is in backfill state".
            text = f"vbucket {vb} is receiving its initial backfill"
            return self._refuse(req, Status.TEMPORARY_FAILURE, text)
        stream = self.streams.get(vb)
        if stream is not None and stream.live:
            # A bad range is refused first (3.0 ``streamRequest``): LATEST and
            # DISKONLY set the end to the high seqno before that check. A
            # notifier's request has no range checks at all.
            if not self.notifier:
                end_known = self.high_seqno is not None or not req.flags & _RESOLVED_END
                if self.high_seqno is not None:
                    req = resolve_end(req, self.high_seqno(vb))
                refused = range_refusal(req, self._draft, end_known=end_known)
                if refused is not None:
                    return (Reply(encode(refused, self.dialect)),)
            return self._refuse(req, Status.KEY_EXISTS, f"vbucket {vb} already streams")
        return (StreamWanted(req),)

    def _failover_log(self, req: GetFailoverLog, _now: float) -> tuple[Output, ...]:
        return (LogWanted(req),)

    def _close_stream(self, req: CloseStream, _now: float) -> tuple[Output, ...]:
        # 3.0 ``closeStream`` erases the stream from the map, live or ended (an
        # ended one is KEY_ENOENT), so STAT dcp no longer lists it.
        stream = self.streams.pop(req.vbucket, None)
        if stream is None or not stream.live:
            return self._refuse(req, Status.KEY_NOT_FOUND, f"no stream for vbucket {req.vbucket}")
        return (EndStream(stream), self._ok(Command.CLOSE_STREAM, req.opaque))

    def _response(self, event: Any) -> tuple[Output, ...]:
        # ep-engine 3.0 upr-producer.cc ``handleResponse``: a reply a stream waits
        # for goes to it whatever its status; item and STREAM_END replies are
        # ignored; anything else drops the connection.
        command = getattr(event, "command", None) or event.COMMAND
        if command is Command.NOOP:
            if event.opaque != self._noop_last:
                return (Fail(self._unexpected(command, "opaque", event.opaque)),)
            self._noop_outstanding = None
        elif command is Command.SET_VBUCKET_STATE or command is Command.SNAPSHOT_MARKER:
            for stream in self.streams.values():
                if stream.opaque == event.opaque and stream.live:
                    return (Deliver(stream, event),)
        elif command not in _IGNORED_RESPONSES:
            return (Fail(self._unexpected(command, "opcode", self.dialect.opcodes[command])),)
        return NOTHING

    def _unexpected(self, command: Command, field: str, value: int) -> ProtocolError:
        return ProtocolError(
            f"a consumer's {command.name} response is not one a producer expects",
            opcode=self.dialect.opcodes[command],
            field=field,
            value=value,
            offset=1 if field == "opcode" else 12,
        )

    # -- flow control and settings ----------------------------------------------------

    def _buffer_ack(self, ack: BufferAcknowledgement, _now: float) -> tuple[Output, ...]:
        # memcached 3.0 never answers a buffer ack (upr-producer.cc
        # ``bufferAcknowledgement`` returns success, and success is silent).
        if not self.window.enabled:
            return NOTHING  # nothing was counted, so there is nothing to credit
        self.window.acknowledged(ack.buffer_bytes)
        return ROOM

    def _control(self, req: Control, now: float) -> tuple[Output, ...]:
        key = control_key(req.key)
        if key in NOT_SUPPORTED_CONTROLS:
            # upr-producer.cc ``control``: stream_buffer_size is ENGINE_ENOTSUP.
            text = f"control key {key.decode()!r} is not supported by this producer"
            return self._refuse(req, Status.NOT_SUPPORTED, text)
        value = req.value.rstrip(b"\x00")
        apply = _CONTROLS.get(key)
        outcome = apply(self, value, now) if apply is not None else None
        if isinstance(outcome, str) or outcome is None:
            text = outcome or f"unknown control key {key.decode('utf-8', 'replace')!r}"
            return self._refuse(req, Status.INVALID_ARGUMENTS, text)
        applied = Applied(key, outcome[0])  # before the answer, as the stats read it
        if key == b"connection_buffer_size":
            return (applied, Room(), self._ok(Command.CONTROL, req.opaque))
        return (applied, self._ok(Command.CONTROL, req.opaque))

    def _buffer_size(self, value: bytes, _now: float) -> tuple[object] | str:
        size = parse_uint32(value)
        if size is None:
            return f"connection_buffer_size must be a 32-bit decimal number, not {_shown(value)!r}"
        self.window.set_buffer_size(size)
        return (size,)

    def _enable_noop(self, value: bytes, now: float) -> tuple[object] | str:
        # ep-engine 3.0 upr-producer.cc ``UprProducer::control``: "true" turns NOOPs on,
        # any other value turns them off; neither is refused.
        self.noop_enabled = value == b"true"
        self._noop_due = now + self.noop_interval if self.noop_enabled else None
        return (self.noop_enabled,)

    def _noop_interval(self, value: bytes, now: float) -> tuple[object] | str:
        # 3.0 reads whole seconds (``parseUint32``), 0 included; its clock ticks
        # in seconds, so 0 means a NOOP at the next second. A fraction is ours.
        whole = parse_uint32(value)
        if whole is not None:
            interval: float | None = float(whole or 1)
        else:
            interval = seconds(value) if b"." in value else None
        if interval is None:
            return f"set_noop_interval must be a positive number of seconds, not {_shown(value)!r}"
        self.noop_interval = interval
        if self.noop_enabled:
            self._noop_due = now + interval  # settings changed: the interval starts again
        return (interval,)

    def _expiry_opcode(self, value: bytes, _now: float) -> tuple[object] | str:
        flag = _TRUE_FALSE.get(value)
        if flag is None:
            return f"enable_expiry_opcode must be true or false, not {_shown(value)!r}"
        if flag and not self.delete_times:
            # Servers that know the expiry opcode send EXPIRATION only in the
            # delete-time layout, so they refuse it on a connection without
            # OPEN flag 0x20 (kv_engine dcp/producer.cc ``control``).
            return "enable_expiry_opcode needs a connection opened with include-delete-times (0x20)"
        self.expiry_opcode = flag
        return (flag,)

    # -- NOOP liveness -----------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``on_timer`` is next due (None: no timer while NOOPs are off)."""
        return self._noop_due

    def on_timer(self, now: float) -> bytes:
        """The NOOP due at ``now`` (empty when nothing is due); raises ``ProtocolError``
        when the consumer has not answered the previous one."""
        due = self._noop_due
        if due is None or now < due:
            return b""
        if self._noop_outstanding is not None:
            raise ProtocolError(
                f"consumer {self.name!r} did not answer a NOOP within "
                f"{self.noop_interval:g} seconds"
            )
        self._noop_outstanding = self._noop_last = next(self._opaques)
        self._noop_due = now + self.noop_interval
        return encode(Noop(opaque=self._noop_outstanding), self.dialect)

    # -- replies ----------------------------------------------------------------------

    def _ok(self, command: Command, opaque: int) -> Reply:
        return Reply(encode(Response(command, opaque, OK), self.dialect))

    def _refuse(self, event: UprEvent, status: int, text: str) -> tuple[Output, ...]:
        command = getattr(event, "COMMAND", Command.OPEN)
        refused = Response(command, event.opaque, status, text.encode())
        return (Reply(encode(refused, self.dialect)),)


_IGNORED_RESPONSES = frozenset(
    {
        Command.MUTATION,
        Command.DELETION,
        Command.EXPIRATION,
        Command.STREAM_END,
        # The draft's own messages, which 3.0 never sends (no reply to refuse).
        Command.STREAM_START,
        Command.SNAPSHOT_START,
        Command.SNAPSHOT_END,
    }
)
"""Replies to stream messages a producer takes and ignores (3.0 ``handleResponse``)."""


def _shown(value: bytes) -> str:
    return value.decode("utf-8", "replace")


_Transition = Callable[[ProducerMachine[Any], Any, float], tuple[Output, ...]]
_REQUESTS: dict[type, _Transition] = {
    StreamRequest: ProducerMachine._stream_request,
    GetFailoverLog: ProducerMachine._failover_log,
    CloseStream: ProducerMachine._close_stream,
    Control: ProducerMachine._control,
    BufferAcknowledgement: ProducerMachine._buffer_ack,
}
"""The transition table: what each request a consumer sends a producer does."""

_Apply = Callable[[ProducerMachine[Any], bytes, float], "tuple[object] | str"]
_CONTROLS: dict[bytes, _Apply] = {
    b"connection_buffer_size": ProducerMachine._buffer_size,
    b"enable_noop": ProducerMachine._enable_noop,
    b"set_noop_interval": ProducerMachine._noop_interval,
    b"enable_expiry_opcode": ProducerMachine._expiry_opcode,
}
"""CONTROL keys we implement: the applied value (in a 1-tuple) or the EINVAL text."""
