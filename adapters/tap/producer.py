"""The producer side of a TAP stream: sequence numbers, acks and retransmits.

Theory of operation. Every message a producer sends gets the next sequence
number as its opaque. With support-ack the producer asks for an ack (TAP flag
ACK) every ``ack_interval`` messages and always on OPAQUE, VBUCKET_SET and
CHECKPOINT_START/END, and keeps every message until an ack covers it: an ack
of sequence number N releases N and everything sent before it. Once
``max_unacked`` messages are outstanding it stops (``can_send`` is false). An
ack of a number the window does not hold (acked already, or never sent)
changes nothing, as 2.x logged "Explicit ack of nonexisting entry" and went
on (``TapProducer::processAck``); ``stray_acks`` counts the never-sent ones. A
nack whose status is BUSY or TEMPORARY_FAILURE acks every message before the
one it names (2.x's implicit acks) and pauses the stream for ``backoff``
seconds, after which everything still outstanding, the nacked message first,
is sent again, in order, with the same sequence numbers (2.x re-queued only
the nacked one and left the later ones to a later ack or a reconnect's
rollback: sending them again too costs duplicates, never a gap); any other
nack is fatal. Without
support-ack nothing is kept: an ack releases nothing, a busy nack still
pauses the stream (with nothing to resend) and any other nack is fatal, as
2.x's ``TapProducer::processAck`` (tapconnection.cc) ran the same code
with an empty ack log; a client built on the classic 2.x Python code acks
every message whether asked or not.

State table (``ProducerState``):

    STREAMING  --nack busy/tmpfail--> BACKING_OFF  --backoff elapsed--> STREAMING
    STREAMING  --other nack--------> FAILED
    any        --close()-----------> CLOSED

Time enters as ``now`` (seconds, any monotonic origin).
"""

from __future__ import annotations

import struct
from collections import deque
from enum import Enum, auto
from typing import TypeVar

from adapters.errors import LocalProtocolError, ProtocolError
from adapters.mcbp.constants import HEADER_SIZE, Magic, Status
from adapters.tap.codec import encode
from adapters.tap.constants import TapFlags, TapOpcode
from adapters.tap.events import (
    EncodedTapFrame,
    Stamped,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapOpaque,
    TapResponse,
    TapStreamMessage,
    TapVbucketSet,
)

DEFAULT_ACK_INTERVAL = 1000
DEFAULT_MAX_UNACKED = 10 * DEFAULT_ACK_INTERVAL
DEFAULT_BACKOFF = 5.0
_RETRYABLE = frozenset({Status.BUSY, Status.TEMPORARY_FAILURE})
_ALWAYS_ACKED = (TapOpaque, TapVbucketSet, TapCheckpointStart, TapCheckpointEnd)
_SEQNO_LIMIT = 1 << 32
SEQNO_MODULUS = _SEQNO_LIMIT - 1
"""Sequence numbers run 1 .. 2**32-1, then 1 again: positions are counted modulo this."""

Kept = Stamped | bytes
"""An outstanding message: a stamped message, or the frame bytes the fast path sent."""


class ProducerState(Enum):
    STREAMING = auto()
    BACKING_OFF = auto()
    FAILED = auto()
    CLOSED = auto()


class TapProducer:
    """Sequence numbers, ack requests and the retransmit window of one TAP stream."""

    def __init__(
        self,
        *,
        support_ack: bool,
        ack_interval: int = DEFAULT_ACK_INTERVAL,
        max_unacked: int = DEFAULT_MAX_UNACKED,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        if ack_interval < 1 or max_unacked < ack_interval:
            raise ValueError("need 1 <= ack_interval <= max_unacked")
        self.support_ack = support_ack
        self.ack_interval = ack_interval
        self.max_unacked = max_unacked
        self.backoff = backoff
        self.state = ProducerState.STREAMING
        self._next_seqno = 1
        self._since_ack_request = 0
        self._outstanding: deque[Kept] = deque()
        self._resume_at = 0.0
        self._last: Kept | None = None
        self.sent_total = 0
        self.acked_total = 0
        self.nacks_total = 0
        self.retransmits_total = 0
        self.stray_acks = 0
        """Acks naming a sequence number never sent (ignored, as 2.x did)."""

    # -- sending ---------------------------------------------------------

    @property
    def can_send(self) -> bool:
        return self.state is ProducerState.STREAMING and (len(self._outstanding) < self.max_unacked)

    @property
    def room(self) -> int:
        """How many messages may be stamped now."""
        if self.state is not ProducerState.STREAMING:
            return 0
        return self.max_unacked - len(self._outstanding)

    @property
    def unacked(self) -> int:
        return len(self._outstanding)

    @property
    def oldest_unacked(self) -> Stamped | None:
        return _stamped(self._outstanding[0]) if self._outstanding else None

    @property
    def last_stamped(self) -> Stamped | None:
        """The message stamped last (a fast-path frame as an ``EncodedTapFrame``)."""
        return None if self._last is None else _stamped(self._last)

    @property
    def last_opaque(self) -> int:
        """The sequence number of the message stamped last (0: none yet)."""
        last = self._last
        if last is None:
            return 0
        return _opaque_of(last)

    def stamp(self, message: TapStreamMessage, *, force_ack: bool = False) -> TapStreamMessage:
        """Give ``message`` its sequence number and ack flag; keep it until acked."""
        seqno, flags = self.next_stamp(
            int(message.tap_flags), force_ack=force_ack or isinstance(message, _ALWAYS_ACKED)
        )
        stamped = _restamped(message, seqno, _tap_flags(flags))
        if self.support_ack:
            self._outstanding.append(stamped)
        self._last = stamped
        return stamped

    def next_stamp(self, tap_flags: int, *, force_ack: bool = False) -> tuple[int, int]:
        """The sequence number and TAP flags of the next message (``stamp`` and the
        fast path's items, which ``keep`` the frame they encode next)."""
        # ``can_send``, spelled out: this runs once per message sent.
        if self.state is not _STREAMING or len(self._outstanding) >= self.max_unacked:
            raise LocalProtocolError(
                f"cannot send in state {self.state.name} with "
                f"{len(self._outstanding)} messages unacked"
            )
        seqno = self._next_seqno
        self._next_seqno = seqno + 1 if seqno + 1 < _SEQNO_LIMIT else 1
        self.sent_total += 1
        flags = tap_flags & _NOT_ACK
        if self.support_ack:
            self._since_ack_request += 1
            if force_ack or self._since_ack_request >= self.ack_interval:
                flags |= _ACK
                self._since_ack_request = 0
        return seqno, flags

    def begin_run(self) -> tuple[int, int, int]:
        """For stamps made in place over a run of at most ``room`` messages (the fast
        path's ``translate_items``, as ``next_stamp`` makes them): the next sequence
        number, the messages since the last ack request, and the ack interval (0
        without support-ack: no ack is asked for); ``end_run`` takes them back."""
        interval = self.ack_interval if self.support_ack else 0
        return self._next_seqno, self._since_ack_request, interval

    def end_run(self, next_seqno: int, since_ack_request: int, stamped: int) -> None:
        """After ``begin_run``: ``stamped`` messages were stamped in place."""
        self._next_seqno = next_seqno
        if self.support_ack:
            self._since_ack_request = since_ack_request
        self.sent_total += stamped

    def keep(self, frame: EncodedTapFrame | bytes) -> None:
        """Remember the frame stamped by ``next_stamp`` as ``stamp`` remembers a message
        (plain bytes: the frame exactly as sent, its opaque and TAP flags in it)."""
        if self.support_ack:
            self._outstanding.append(frame)
        self._last = frame

    def keep_frames(self, frames: list[bytes], start: int) -> None:
        """``keep`` of ``frames[start:]``, each stamped in turn by ``next_stamp``."""
        if start < len(frames):
            if self.support_ack:
                self._outstanding.extend(frames[start:] if start else frames)
            self._last = frames[-1]

    def request_ack_on_last(self) -> Stamped:
        """Ask for an ack on the message stamped last, before it is sent.

        A sender calls this when it has nothing more to send for now, so a
        client that acks only when asked confirms everything outstanding.
        """
        return _stamped(self._ask_on_last())

    def ack_request_on_last(self) -> bytes:
        """``request_ack_on_last``, as the frame bytes to send in place of the last one."""
        last = self._ask_on_last()
        return last if type(last) is bytes else encode(last)  # type: ignore[arg-type]

    def _ask_on_last(self) -> Kept:
        last = self._last
        if last is None:
            raise LocalProtocolError("no message has been stamped")
        flags = _flags_of(last)
        if not self.support_ack or flags & _ACK:
            return last
        if not self._outstanding or self._outstanding[-1] is not last:
            raise LocalProtocolError("the last stamped message was already acked")
        asked: Kept
        if type(last) is bytes:
            frame = bytearray(last)
            _U16.pack_into(frame, _TAP_FLAGS_AT, flags | _ACK)
            asked = bytes(frame)
        else:
            asked = _restamped(last, last.opaque, _tap_flags(flags | _ACK))  # type: ignore[type-var,union-attr]
        self._outstanding[-1] = self._last = asked
        self._since_ack_request = 0
        return asked

    # -- receiving -------------------------------------------------------

    def receive(self, response: TapResponse, now: float) -> list[Stamped]:
        """Apply an ack or nack; return the messages an ack released (oldest first)."""
        count = self._acked_count(
            response.opaque, response.status, now, response.text, response.opcode
        )
        popleft = self._outstanding.popleft
        return [_stamped(popleft()) for _ in range(count)]

    def release(
        self, opaque: int, status: int, now: float, text: bytes = b"", opcode: int = 0
    ) -> int:
        """``receive`` of a response's fields, without handing out what it released:
        how many messages it released, the oldest first (the oldest's sequence
        number was ``first_unacked`` before the call)."""
        count = self._acked_count(opaque, status, now, text, opcode)
        popleft = self._outstanding.popleft
        for _ in range(count):
            popleft()
        return count

    def release_acks(self, opaques: list[int]) -> int:
        """``release`` of successful acks in the order they came (one client read's
        worth): the furthest one decides, as acking them one by one would."""
        if self.state in (ProducerState.FAILED, ProducerState.CLOSED) or not self.support_ack:
            return 0
        outstanding = self._outstanding
        size = len(outstanding)
        first = _opaque_of(outstanding[0]) if size else 0
        furthest = furthest_opaque = -1
        # The window holds consecutive sequence numbers, so an ack's position is
        # arithmetic; only the furthest is checked against the window (a live
        # peer acks two messages per item).
        for opaque in opaques:
            position = (opaque - first) % SEQNO_MODULUS
            if position >= size:
                found = self._position(opaque)
                if found is None:
                    continue  # a late ack, or one for a number never sent
                position = found
            if position > furthest:
                furthest = position
                furthest_opaque = opaque
        if furthest >= 0 and _opaque_of(outstanding[furthest]) != furthest_opaque:
            furthest = self._furthest(opaques)
        count = furthest + 1
        self.acked_total += count
        if count == size:
            outstanding.clear()  # (what a peer that acks when asked usually releases)
            return count
        popleft = outstanding.popleft
        for _ in range(count):
            popleft()
        return count

    def _furthest(self, opaques: list[int]) -> int:
        """``release_acks``'s furthest position, every ack looked up in the window."""
        furthest = -1
        for opaque in opaques:
            position = self._position(opaque)
            if position is not None and position > furthest:
                furthest = position
        return furthest

    def _acked_count(self, opaque: int, status: int, now: float, text: bytes, opcode: int) -> int:
        if self.state in (ProducerState.FAILED, ProducerState.CLOSED):
            return 0
        if status == _SUCCESS:
            if not self.support_ack:
                return 0  # nothing is kept to release (a client that acks every message)
            position = self._position(opaque)
            if position is None:
                return 0  # a late ack, or one for a number never sent
            self.acked_total += position + 1
            return position + 1
        self.nacks_total += 1
        if status in _RETRYABLE:
            self.state = ProducerState.BACKING_OFF
            self._resume_at = now + self.backoff
            if not self.support_ack:
                return 0
            # Everything before the nacked message was applied (processAck's
            # implicit acks); a nack of a number not outstanding releases nothing.
            position = self._position(opaque)
            if position is None:
                return 0
            self.acked_total += position
            return position
        self.state = ProducerState.FAILED
        message = text.decode("utf-8", "replace")
        raise ProtocolError(
            f"client refused a message ({message})" if message else "client refused a message",
            opcode=opcode,
            field="status",
            value=status,
        )

    @property
    def first_unacked(self) -> int:
        """The sequence number of the oldest outstanding message (0: none)."""
        return _opaque_of(self._outstanding[0]) if self._outstanding else 0

    def _position(self, seqno: int) -> int | None:
        outstanding = self._outstanding
        if outstanding:
            # The window holds consecutive sequence numbers: look where it must be.
            position = (seqno - _opaque_of(outstanding[0])) % SEQNO_MODULUS
            if position < len(outstanding) and _opaque_of(outstanding[position]) == seqno:
                return position
        for index, message in enumerate(outstanding):
            if _opaque_of(message) == seqno:
                return index
        if not self._was_sent(seqno):
            self.stray_acks += 1
        return None

    def _was_sent(self, seqno: int) -> bool:
        # Sequence numbers wrap at 2**32; after a wrap every number has been used.
        return 0 < seqno <= self.sent_total or self.sent_total >= _SEQNO_LIMIT - 1

    # -- time ------------------------------------------------------------

    def retransmit_due(self, now: float) -> list[Stamped]:
        """After a backoff: everything outstanding, to be sent again in order."""
        if self.state is not ProducerState.BACKING_OFF or now < self._resume_at:
            return []
        self.state = ProducerState.STREAMING
        self.retransmits_total += len(self._outstanding)
        return [_stamped(message) for message in self._outstanding]

    def retransmit_frames(self, now: float) -> list[bytes]:
        """``retransmit_due`` as the frames to send."""
        if self.state is not ProducerState.BACKING_OFF or now < self._resume_at:
            return []
        self.state = ProducerState.STREAMING
        self.retransmits_total += len(self._outstanding)
        return [m if type(m) is bytes else encode(m) for m in self._outstanding]  # type: ignore[arg-type]

    def next_deadline(self) -> float | None:
        """When ``retransmit_due`` will next have something to do."""
        return self._resume_at if self.state is ProducerState.BACKING_OFF else None

    def close(self) -> None:
        self.state = ProducerState.CLOSED


_SET = object.__setattr__
_STREAMING = ProducerState.STREAMING
_SUCCESS = Status.SUCCESS.value
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_OPAQUE_AT = 12
_TAP_FLAGS_AT = HEADER_SIZE + 2
_ACK = TapFlags.ACK.value
_NOT_ACK = ~_ACK
_FLAGS: dict[int, TapFlags] = {}
_M = TypeVar("_M", bound=Stamped)


_HEADER = struct.Struct(">BBHBBHII")
"""A response header up to its opaque: magic, opcode, key and extras lengths,
datatype, status, body length, opaque."""
_RESPONSE = Magic.RESPONSE.value
_TAP_OPCODES = frozenset(opcode.value for opcode in TapOpcode)


def successful_acks(buf: bytes | bytearray, offset: int, opaques: list[int], max_body: int) -> int:
    """The opaques of the run of successful TAP acks in ``buf`` from ``offset``,
    framed by body length alone as 2.x read them (the body of an ack says
    nothing), appended to ``opaques``; the offset after the last one. Stops
    before anything else (a nack, a request, a frame not whole, a body over
    ``max_body``), which the frame reader then takes: what ``release_acks``
    needs of a peer's read without a ``Frame`` per ack."""
    end = len(buf)
    unpack_from = _HEADER.unpack_from
    append = opaques.append
    while end - offset >= HEADER_SIZE:
        magic, opcode, _, _, _, status, bodylen, opaque = unpack_from(buf, offset)
        if magic != _RESPONSE or status or opcode not in _TAP_OPCODES or bodylen > max_body:
            break
        frame_end = offset + HEADER_SIZE + bodylen
        if frame_end > end:
            break
        append(opaque)
        offset = frame_end
    return offset


def _tap_flags(value: int) -> TapFlags:
    """``TapFlags(value)``, cached: building a Flag costs more than the rest of a stamp."""
    flags = _FLAGS.get(value)
    if flags is None:
        flags = TapFlags(value)
        if len(_FLAGS) < 256:
            _FLAGS[value] = flags
    return flags


def _restamped(message: _M, opaque: int, tap_flags: TapFlags) -> _M:
    """A copy with another opaque and TAP flags (``dataclasses.replace`` costs twice as
    much, and this runs once per message sent)."""
    clone = object.__new__(type(message))
    for name in type(message).__slots__:
        _SET(clone, name, getattr(message, name))
    _SET(clone, "opaque", opaque)
    _SET(clone, "tap_flags", tap_flags)
    return clone


def _opaque_of(message: Kept) -> int:
    if type(message) is bytes:
        opaque: int = _U32.unpack_from(message, _OPAQUE_AT)[0]
        return opaque
    return message.opaque  # type: ignore[union-attr]


def _flags_of(message: Kept) -> int:
    if type(message) is bytes:
        flags: int = _U16.unpack_from(message, _TAP_FLAGS_AT)[0]
        return flags
    return int(message.tap_flags)  # type: ignore[union-attr]


def _stamped(message: Kept) -> Stamped:
    """A kept frame as the ``EncodedTapFrame`` the message-level API hands out."""
    if type(message) is bytes:
        return EncodedTapFrame(
            message, _U16.unpack_from(message, 6)[0], _opaque_of(message), _flags_of(message)
        )
    return message  # type: ignore[return-value]
