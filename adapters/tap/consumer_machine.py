"""A TAP consumer connection without I/O: what each packet from the producer asks for.

Theory of operation. ``TapConsumerMachine`` holds what a TAP consumer decides
about the packets a producer sends it, the way h11 holds an HTTP connection:
the I/O side hands it each frame (``receive_frame``) or an event it decoded
itself (``receive``) and acts on the ``Decision`` that comes back; nothing
here waits, reads a clock or touches a socket. Two consumers use it: the
reference node receiving a stream pushed into it (a 2.x replica), and the UPR
front's ingest, which dialed its upstream and sent the CONNECT (``dialed``).
What the messages do to a store or a log stays theirs; the machine says
whether to apply a message and what to answer, as memcached 2.x's
``process_bin_tap_packet`` and ep-engine's ``tapNotify`` did:

- a stream message (MUTATION, DELETE, FLUSH, OPAQUE, VBUCKET_SET,
  CHECKPOINT_START/END) is applied (``APPLY``), then answered with its ack
  when it carries TapFlags.ACK (``Decision.reply``: same opcode and opaque,
  status 0); one the consumer cannot apply gets a nack (``nack``), asked for
  or not. An OPAQUE whose engine-specific length is not the 4 bytes of its
  code is not applied: logged and acked if asked (``SKIP``), as 2.5.1
  ep_engine.cc ``tapNotify`` did ("Received tap opaque with unknown size");
- a TTL of 0 (relayed too often, probably in a loop) is nacked
  INVALID_ARGUMENTS, as memcached does before the engine sees it. The node
  goes on (``NACK``), as memcached did; the ingest closes after the nack
  (``CLOSE``): the 2.x producer closes on it anyway;
- NOOP is answered (``ANSWER``); a NOOP response or an ack is ignored;
  any other response closes a dialed consumer (``CLOSE``, nothing sent: it
  is its CONNECT refused or a producer it cannot follow) and is ignored by
  an accepting one (answers to its NOOPs, stray acks);
- CONNECT is refused NOT_SUPPORTED and closes: this end consumes;
- a TAP request that does not decode is refused with its error and closes;
  a response that does not decode closes. A dialed consumer sends no
  refusal: to a 2.x producer it would be the nack of that message, which
  acks everything before it, and nothing since the last commit is durable;
- a request with an opcode no TAP consumer knows is answered
  UNKNOWN_COMMAND with an empty body and the stream goes on (memcached
  ``process_bin_unknown_packet`` hands it to ep-engine, whose
  ``processUnknownCommand`` answers so), noted once per opcode.

Once the consumer applied a message it says so (``applied``), and the
machine keeps the vbuckets in their backfill phase (``backfill``, which the
node shares with its UPR producers, whose STREAM_REQs for them are TMPFAIL):
from OPAQUE(INITIAL_VBUCKET_STREAM) to the first CHECKPOINT_START of an id
over 0, or to a VBUCKET_SET to ACTIVE (3.0 src/ep.cc ``setVBucketState``
resets the vbucket with open checkpoint 0 until src/tapconnection.cc
``processCheckpointCommand`` takes the sender's id, or ``VBucket::setState``
makes it active).

Dispatch is by event class (``_TRANSITIONS``, the one table; ``_APPLIED`` for
what an applied message changes); OPAQUE codes that change the connection
(CLOSE_TAP_STREAM: the sender is done) are in ``_OPAQUE_EFFECTS``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, MutableSet
from typing import Any, NamedTuple

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, Status, encode_frame, error_response
from adapters.tap.acks import ack_of, ack_opcode
from adapters.tap.codec import decode_frame, encode, is_tap_opcode
from adapters.tap.constants import OpaqueCode, TapFlags, TapOpcode, VBucketState
from adapters.tap.events import (
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDelete,
    TapEvent,
    TapFlush,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapResponse,
    TapStreamMessage,
    TapVbucketSet,
)
from adapters.upr.consumer_machine import Note

__all__ = ["Decision", "Do", "Note", "TapConsumerMachine"]

_ACK = int(TapFlags.ACK)
OPAQUE_CODE_LENGTH = 4
"""The engine-specific length of an OPAQUE: its u32 code."""


class Do(enum.Enum):
    """What the I/O side does with a packet."""

    APPLY = "apply"
    """Apply ``message``; then send ``reply`` (its ack, or nothing), or a ``nack``."""
    SKIP = "skip"
    """Do not apply ``message``; send ``reply`` (its ack, or nothing)."""
    ANSWER = "answer"
    """Send ``reply`` and go on (NOOP, an unknown request)."""
    NACK = "nack"
    """Send ``reply``, a nack, and go on."""
    IGNORE = "ignore"
    """Nothing to do."""
    CLOSE = "close"
    """Send ``reply`` (if any), then close the connection with ``error``."""


class Decision(NamedTuple):
    do: Do
    event: TapEvent | None = None
    """What the packet decoded to (None when it did not)."""
    reply: bytes = b""
    error: ProtocolError | None = None
    note: Note | None = None

    @property
    def message(self) -> TapStreamMessage:
        """The stream message to apply (``APPLY``, ``SKIP``, ``NACK``)."""
        return self.event  # type: ignore[return-value]


class TapConsumerMachine:
    """One TAP consumer connection's decisions (see the module docstring)."""

    def __init__(self, peer: str, *, dialed: bool, backfill: MutableSet[int] | None = None) -> None:
        self.peer = peer
        """Who sends, as the notes name it."""
        self.dialed = dialed
        """This end sent the CONNECT (the ingest), else the peer pushes into it (the node)."""
        self.messages = 0
        """Stream messages to apply, skipped or nacked."""
        self.nacks = 0
        self.unknown_requests = 0
        self._unknown_said: set[int] = set()
        self.closing = False
        """OPAQUE(CLOSE_TAP_STREAM) arrived: the sender is done."""
        self.backfill: MutableSet[int] = set() if backfill is None else backfill
        """Vbuckets in their backfill phase (see the module docstring)."""

    def receive_frame(self, frame: Frame) -> Decision:
        """Decode ``frame`` and decide about it."""
        try:
            event = decode_frame(frame)
        except ProtocolError as exc:
            return self._undecodable(frame, exc)
        return self.receive(event, frame)

    def receive(self, event: TapEvent, frame: Frame | None = None) -> Decision:
        """Decide about one decoded event (``frame``: the packet it came in, if any)."""
        return _TRANSITIONS[type(event)](self, event, frame)

    def applied(self, message: TapStreamMessage) -> None:
        """The consumer applied ``message`` (an ``APPLY``): the phase it starts or ends."""
        effect = _APPLIED.get(type(message))
        if effect is not None:
            effect(self, message)

    def nack(self, message: TapStreamMessage, status: int, text: str) -> bytes:
        """The answer to a message the consumer could not apply (sent, asked for or not)."""
        self.nacks += 1
        return ack_of(message, status, text.encode())

    # -- transitions ---------------------------------------------------------------

    def _stream_message(self, message: TapStreamMessage, _frame: Frame | None) -> Decision:
        self.messages += 1
        if not message.ttl:
            return self._expired(message)
        ack = ack_of(message) if int(message.tap_flags) & _ACK else b""
        return Decision(Do.APPLY, message, ack)

    def _expired(self, message: TapStreamMessage) -> Decision:
        nack = self.nack(message, Status.INVALID_ARGUMENTS, "TTL expired")
        if not self.dialed:
            return Decision(Do.NACK, message, nack)
        error = ProtocolError(
            "TTL expired (relayed too often)", opcode=ack_opcode(message), field="ttl", value=0
        )
        return Decision(Do.CLOSE, message, nack, error)

    def _opaque(self, message: TapOpaque, frame: Frame | None) -> Decision:
        decision = self._stream_message(message, frame)
        if decision.do is not Do.APPLY:
            return decision
        es_len = message.engine_specific_length
        if es_len != OPAQUE_CODE_LENGTH:
            text = (
                f"{self.peer}: OPAQUE of unknown size (opcode=0x{TapOpcode.OPAQUE:02x} "
                f"field=engine_specific_length value={es_len}, vbucket {message.vbucket}): "
                "ignored, as 2.5.1 did"
            )
            return decision._replace(do=Do.SKIP, note=Note("warning", text))
        effect = _OPAQUE_EFFECTS.get(message.opaque_code)
        if effect is not None:
            effect(self)
        return decision

    def _close_tap_stream(self) -> None:
        self.closing = True

    def _opaque_applied(self, message: TapOpaque) -> None:
        if message.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM:
            self.backfill.add(message.vbucket)

    def _checkpoint_applied(self, message: TapCheckpointStart) -> None:
        if message.checkpoint_id:  # 3.0 ends the backfill phase only for an id over 0
            self.backfill.discard(message.vbucket)

    def _state_applied(self, message: TapVbucketSet) -> None:
        if message.state == VBucketState.ACTIVE:
            self.backfill.discard(message.vbucket)

    def _noop(self, event: TapNoop, _frame: Frame | None) -> Decision:
        return Decision(Do.ANSWER, event, encode(TapNoopResponse(event.opaque)))

    def _ignored(self, event: TapEvent, _frame: Frame | None) -> Decision:
        return Decision(Do.IGNORE, event)

    def _response(self, event: TapResponse, _frame: Frame | None) -> Decision:
        if not self.dialed:
            return Decision(Do.IGNORE, event)  # a stray ack: no sender takes one here
        text = event.text.decode("utf-8", "replace")
        error = ProtocolError(
            f"{self.peer} answered 0x{event.status:02x} to {event.opcode.name}: {text}",
            opcode=event.opcode,
            field="status",
            value=event.status,
        )
        return Decision(Do.CLOSE, event, error=error)

    def _connect(self, event: TapConnect, frame: Frame | None) -> Decision:
        error = ProtocolError(
            "CONNECT inside a TAP stream", opcode=TapOpcode.CONNECT, status=Status.NOT_SUPPORTED
        )
        if frame is None:
            frame = Frame(Magic.REQUEST, TapOpcode.CONNECT, 0, 0, 0, 0, event.opaque, 0, b"")
        return self._refuse(event, frame, error)

    def _undecodable(self, frame: Frame, exc: ProtocolError) -> Decision:
        if not frame.is_request:
            return Decision(Do.CLOSE, error=exc)  # memcached closes on a response it cannot read
        if is_tap_opcode(frame.opcode):
            return self._refuse(None, frame, exc)
        self.unknown_requests += 1
        note = None
        if frame.opcode not in self._unknown_said:
            self._unknown_said.add(frame.opcode)
            text = (
                f"{self.peer}: unknown request (opcode=0x{frame.opcode:02x} field=opcode "
                f"value={frame.opcode}, opaque {frame.opaque}): answered UNKNOWN_COMMAND, "
                "the TAP stream goes on"
            )
            note = Note("warning", text)
        reply = encode_frame(
            Magic.RESPONSE,
            frame.opcode,
            vbucket_or_status=Status.UNKNOWN_COMMAND,
            opaque=frame.opaque,
        )  # an empty body, as 2.x sent
        return Decision(Do.ANSWER, reply=reply, note=note)

    def _refuse(self, event: TapEvent | None, frame: Frame, error: ProtocolError) -> Decision:
        # A dialed consumer's error response would read as a nack of that opaque,
        # which acks what came before: it closes unanswered, leaving that unacked.
        reply = b"" if self.dialed else error_response(frame, error)
        return Decision(Do.CLOSE, event, reply, error)


_Transition = Callable[[TapConsumerMachine, Any, "Frame | None"], Decision]
_TRANSITIONS: dict[type, _Transition] = {
    TapMutation: TapConsumerMachine._stream_message,
    TapDelete: TapConsumerMachine._stream_message,
    TapFlush: TapConsumerMachine._stream_message,
    TapVbucketSet: TapConsumerMachine._stream_message,
    TapCheckpointStart: TapConsumerMachine._stream_message,
    TapCheckpointEnd: TapConsumerMachine._stream_message,
    TapOpaque: TapConsumerMachine._opaque,
    TapNoop: TapConsumerMachine._noop,
    TapNoopResponse: TapConsumerMachine._ignored,
    TapResponse: TapConsumerMachine._response,
    TapConnect: TapConsumerMachine._connect,
}
"""The transition table: what each packet a TAP consumer receives asks for."""

_APPLIED: dict[type, Callable[[TapConsumerMachine, Any], None]] = {
    TapOpaque: TapConsumerMachine._opaque_applied,
    TapCheckpointStart: TapConsumerMachine._checkpoint_applied,
    TapVbucketSet: TapConsumerMachine._state_applied,
}
"""What an applied message changes in the backfill phases."""

_OPAQUE_EFFECTS: dict[OpaqueCode | int, Callable[[TapConsumerMachine], None]] = {
    OpaqueCode.CLOSE_TAP_STREAM: TapConsumerMachine._close_tap_stream,
}
"""OPAQUE codes that change the connection; the others announce the sender's
features or phases, which the consumer applies (or not) itself."""
