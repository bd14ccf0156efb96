"""A node's UPR consumer connection without I/O: ADD_STREAM, its STREAM_REQ, the stream.

Theory of operation. ``ConsumerMachine`` holds what a node decides as the
consumer of one connection (the end of a vbucket move), the way h11 holds an
HTTP connection: the I/O side hands it each decoded event (``receive``) with
the wall-clock time the store stamps writes with, and acts on what comes
back, in order: ``Reply`` bytes to send, ``Note`` lines to log. The vbuckets
themselves are the role's ``Replica``: the machine reads their position and
writes what the producer sends through it, synchronously; nothing here
waits, reads a clock or touches a socket.

Whoever opened the connection (an orchestrator, or the gateway) sends
ADD_STREAM(vbucket, flags); the machine answers with the opaque it will use
for that stream and then sends, on the same connection, its own STREAM_REQ
built from the vbucket's position: start = high seqno, the newest failover
uuid, and the last snapshot received (so a consumer stopped mid-snapshot
resumes it). The orchestrator relays it to a producer, whose answer and
stream come back here. Events, by class (``_TRANSITIONS``, the one table):

- ADD_STREAM: NOT_MY_VBUCKET for a vbucket the replica does not receive
  (not here, ACTIVE or DEAD: writes of its own would clash with the
  producer's seqnos), KEY_EXISTS while the vbucket has a live stream; else
  the stream's opaque, then its STREAM_REQ.
- STREAM_REQ answers to a pending stream: OK replaces the failover log and
  the stream reads; ROLLBACK(seqno) rolls the vbucket back and requests
  again from there, up to ``MAX_ROLLBACKS`` times, then the stream is dead;
  any other status kills the stream. Other responses (a CONTROL's, a
  BUFFER_ACKNOWLEDGEMENT's) are noted when refused.
- SNAPSHOT_MARKER records the snapshot being received (the resume point);
  with the ACK flag the node answers once the marker's end seqno is applied
  (or at the next marker, SET_VBUCKET_STATE, whichever comes first). A DISK
  marker into an empty vbucket puts it in ``backfill`` until its end seqno
  is applied or the next marker (ep-engine 3.0 src/upr-stream.cc
  ``PassiveStream::processMarker`` opens checkpoint 0, ``handleSnapshotEnd``
  gives it one again; ``UprProducer::streamRequest`` answers TMPFAIL).
- MUTATION/DELETION/EXPIRATION are applied with the producer's seqnos and
  metadata; one the replica cannot apply raises ``ProtocolError`` (close).
- SET_VBUCKET_STATE sets the vbucket's state and is answered (KEY_ENOENT
  with no reading stream); becoming ACTIVE ends a backfill (3.0 src/
  vbucket.cc ``VBucket::setState`` opens checkpoint 2 at least).
- STREAM_END kills the stream; CLOSE_STREAM too, and is answered
  (KEY_ENOENT for no live stream). NOOP is answered.
- A stream message for no reading stream (opaque and vbucket) is dropped;
  FLUSH is dropped; any other request a consumer does not take is
  NOT_SUPPORTED.

Opaques: the machine numbers its own requests (``next_opaque``), and the
I/O side takes its CONTROL's and BUFFER_ACKNOWLEDGEMENTs' from the same
counter, so none collides with a stream's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, MutableSet
from typing import Any, NamedTuple, Protocol

from adapters.mcbp import Status
from adapters.mcbp.constants import VBucketState
from adapters.upr.codec import encode
from adapters.upr.constants import Command, SnapshotFlags, StreamFlags
from adapters.upr.dialect import Dialect
from adapters.upr.events import (
    AddStream,
    CloseStream,
    Deletion,
    Expiration,
    Flush,
    Mutation,
    Noop,
    SetVbucketState,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    UprEvent,
    UprRequest,
)
from adapters.upr.producer_machine import Reply
from adapters.upr.responses import (
    AddStreamResponse,
    Response,
    StreamRequestOk,
    StreamRequestRollback,
)

OK = Status.SUCCESS.value
MAX_ROLLBACKS = 8
"""Rollbacks accepted for one ADD_STREAM before the stream is given up."""
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF

Item = Mutation | Deletion | Expiration


class Replica(Protocol):
    """The vbuckets a consumer connection writes into (the node's store)."""

    def receives(self, vbucket: int) -> bool:
        """Whether ``vbucket`` is here and may take a producer's stream."""
        ...

    def high_seqno(self, vbucket: int) -> int: ...

    def snapshot(self, vbucket: int) -> tuple[int, int]: ...

    def set_snapshot(self, vbucket: int, start: int, end: int) -> None: ...

    def uuid(self, vbucket: int) -> int: ...

    def replace_failover_log(self, vbucket: int, entries: Any) -> None: ...

    def rollback(self, vbucket: int, seqno: int) -> int:
        """Drop what is above ``seqno``; the new high seqno."""
        ...

    def apply(self, item: Item, now: float) -> None:
        """Write one stream item; raises ``ProtocolError`` when it cannot."""
        ...

    def set_state(self, vbucket: int, state: VBucketState, now: float) -> None: ...


class Note(NamedTuple):
    level: str
    """``debug``, ``info`` or ``warning``."""
    text: str


Output = Reply | Note
NOTHING: tuple[Output, ...] = ()


class PassiveStream:
    """One vbucket this node is receiving."""

    def __init__(self, vbucket: int, opaque: int, flags: StreamFlags) -> None:
        self.vbucket = vbucket
        self.opaque = opaque
        self.flags = flags
        self.state = "pending"
        """pending (requested), reading (accepted), dead."""
        self.snapshot = (0, 0)
        self.ack_due = False
        """The current snapshot's marker asked for an ACK, not sent yet."""
        self.rollbacks = 0
        self.items_received = 0
        self.last_seqno = 0

    def stats(self) -> list[tuple[str, str]]:
        prefix = f"stream_{self.vbucket}_"
        values: list[tuple[str, object]] = [
            ("state", self.state),
            ("opaque", self.opaque),
            ("flags", f"0x{int(self.flags):x}"),
            ("items_received", self.items_received),
            ("last_received_seqno", self.last_seqno),
            ("snap_start_seqno", self.snapshot[0]),
            ("snap_end_seqno", self.snapshot[1]),
            ("rollbacks", self.rollbacks),
        ]
        return [(prefix + name, str(value)) for name, value in values]


class ConsumerMachine:
    """One consumer connection's decisions (see the module docstring)."""

    def __init__(self, dialect: Dialect, replica: Replica, backfill: MutableSet[int]) -> None:
        self.dialect = dialect
        self.replica = replica
        self.backfill = backfill
        """Vbuckets receiving their initial backfill, shared by the node's connections."""
        self.streams: dict[int, PassiveStream] = {}
        """By vbucket; a dead stream stays (for its stats) until replaced."""
        self._by_opaque: dict[int, PassiveStream] = {}
        self._opaques = itertools.count(1)
        self.items_received = 0

    def next_opaque(self) -> int:
        return next(self._opaques)

    def receive(self, event: UprEvent, now: float) -> tuple[Output, ...]:
        """What to do about one event from the peer; ``now`` stamps the writes."""
        transition = _TRANSITIONS.get(type(event))
        if transition is not None:
            return transition(self, event, now)
        if event.IS_RESPONSE:
            return (Note("debug", f"ignoring response {event!r}"),)
        if isinstance(event, Flush):
            return NOTHING  # a producer's FLUSH has no place in a stream; dropped
        request: UprRequest = event  # type: ignore[assignment]  # responses went above
        text = f"{request.NAME} is not for a consumer"
        return self._answer(request.COMMAND, request.opaque, Status.NOT_SUPPORTED.value, text)

    # -- stream set-up -------------------------------------------------------------

    def _add_stream(self, req: AddStream, _now: float) -> tuple[Output, ...]:
        vb = req.vbucket
        live = self.streams.get(vb)
        status: Status | None = None
        if not self.replica.receives(vb):
            status = Status.NOT_MY_VBUCKET
        elif live is not None and live.state != "dead":
            status = Status.KEY_EXISTS
        if status is not None:
            return (self._reply(AddStreamResponse(0, req.opaque, status.value)),)
        stream = PassiveStream(vb, self.next_opaque(), req.flags)
        self.streams[vb] = stream
        self._by_opaque[stream.opaque] = stream
        added = self._reply(AddStreamResponse(stream.opaque, req.opaque, OK))
        return (added, self._reply(self.stream_request(stream)))

    def stream_request(self, stream: PassiveStream) -> StreamRequest:
        """The STREAM_REQ for ``stream`` from its vbucket's position now."""
        vb = stream.vbucket
        high = self.replica.high_seqno(vb)
        snap_start, snap_end = self.replica.snapshot(vb)
        if not snap_start <= high <= snap_end:
            snap_start = snap_end = high  # no partial snapshot to resume
        return StreamRequest(
            flags=stream.flags,
            start_seqno=high,
            end_seqno=MAX_SEQNO,
            vbucket_uuid=self.replica.uuid(vb),
            snap_start_seqno=snap_start,
            snap_end_seqno=snap_end,
            opaque=stream.opaque,
            vbucket=vb,
        )

    def _pending(self, opaque: int) -> PassiveStream | None:
        stream = self._by_opaque.get(opaque)
        return stream if stream is not None and stream.state == "pending" else None

    def _accepted(self, event: StreamRequestOk, _now: float) -> tuple[Output, ...]:
        stream = self._pending(event.opaque)
        if stream is not None:
            self.replica.replace_failover_log(stream.vbucket, event.failover_log)
            stream.state = "reading"
        return NOTHING

    def _roll_back(self, event: StreamRequestRollback, _now: float) -> tuple[Output, ...]:
        stream = self._pending(event.opaque)
        if stream is None:
            return NOTHING
        vb = stream.vbucket
        stream.rollbacks += 1
        if stream.rollbacks > MAX_ROLLBACKS:
            stream.state = "dead"
            return (Note("warning", f"vbucket {vb} keeps rolling back; giving up"),)
        high = self.replica.rollback(vb, event.rollback_seqno)
        self.replica.set_snapshot(vb, high, high)
        return (self._reply(self.stream_request(stream)),)

    def _response(self, event: Response, _now: float) -> tuple[Output, ...]:
        status = f"0x{event.status:02x} {event.value!r}"
        if event.command is not Command.STREAM_REQ:
            if event.status == OK:
                return NOTHING
            return (Note("warning", f"{event.command.name} refused: {status}"),)
        stream = self._pending(event.opaque)
        if stream is None:
            return NOTHING
        stream.state = "dead"
        text = f"stream request for vbucket {stream.vbucket} refused: {status}"
        return (Note("warning", text),)

    # -- the stream ----------------------------------------------------------------

    def _reading(self, event: UprRequest) -> PassiveStream | None:
        stream = self._by_opaque.get(event.opaque)
        if stream is None or stream.state != "reading" or stream.vbucket != event.vbucket:
            return None
        return stream

    def _dropped(self, event: UprRequest) -> tuple[Output, ...]:
        return (Note("debug", f"{event.NAME} for no open stream (opaque {event.opaque})"),)

    def _marker(self, marker: SnapshotMarker, _now: float) -> tuple[Output, ...]:
        stream = self._reading(marker)
        if stream is None:
            return self._dropped(marker)
        out = self._marker_ack(stream)  # a producer whose last marker overshot
        vb = stream.vbucket
        stream.snapshot = (marker.start_seqno, marker.end_seqno)
        stream.ack_due = bool(marker.flags & SnapshotFlags.ACK)
        if marker.flags & SnapshotFlags.DISK and not self.replica.high_seqno(vb):
            self.backfill.add(vb)  # stream requests for it: TMPFAIL until its end
        else:
            self.backfill.discard(vb)
        self.replica.set_snapshot(vb, marker.start_seqno, marker.end_seqno)
        if stream.ack_due and self.replica.high_seqno(vb) >= marker.end_seqno:
            out += self._marker_ack(stream)
        return out

    def _marker_ack(self, stream: PassiveStream) -> tuple[Output, ...]:
        if not stream.ack_due:
            return NOTHING
        stream.ack_due = False
        return self._answer(Command.SNAPSHOT_MARKER, stream.opaque, OK)

    def _item(self, event: Item, now: float) -> tuple[Output, ...]:
        stream = self._reading(event)
        if stream is None:
            return self._dropped(event)
        self.replica.apply(event, now)
        stream.items_received += 1
        stream.last_seqno = event.by_seqno
        self.items_received += 1
        if event.by_seqno >= stream.snapshot[1]:
            # 3.0.0 src/upr-stream.cc ``PassiveStream::handleSnapshotEnd``: the
            # snapshot's end applied ends the backfill phase (a checkpoint again).
            self.backfill.discard(event.vbucket)
            return self._marker_ack(stream)
        return NOTHING

    def _set_vbucket_state(self, event: SetVbucketState, now: float) -> tuple[Output, ...]:
        stream = self._reading(event)
        if stream is None:
            status = Status.KEY_NOT_FOUND.value
            return self._answer(Command.SET_VBUCKET_STATE, event.opaque, status)
        out = self._marker_ack(stream)
        self.replica.set_state(event.vbucket, event.state, now)
        if event.state == VBucketState.ACTIVE:
            self.backfill.discard(event.vbucket)
        return out + self._answer(Command.SET_VBUCKET_STATE, event.opaque, OK)

    def _stream_end(self, event: StreamEnd, _now: float) -> tuple[Output, ...]:
        stream = self._by_opaque.get(event.opaque)
        if stream is None or stream.vbucket != event.vbucket:
            return NOTHING
        stream.state = "dead"
        reason = getattr(event.reason, "name", event.reason)
        return (Note("info", f"stream of vbucket {event.vbucket} ended: {reason}"),)

    def _close_stream(self, req: CloseStream, _now: float) -> tuple[Output, ...]:
        stream = self.streams.get(req.vbucket)
        if stream is None or stream.state == "dead":
            status = Status.KEY_NOT_FOUND.value
        else:
            stream.state, status = "dead", OK
        return self._answer(Command.CLOSE_STREAM, req.opaque, status)

    def _noop(self, req: Noop, _now: float) -> tuple[Output, ...]:
        return self._answer(Command.NOOP, req.opaque, OK)

    # -- replies ---------------------------------------------------------------------

    def _reply(self, event: UprEvent) -> Reply:
        return Reply(encode(event, self.dialect))

    def _answer(self, command: Command, opaque: int, status: int, text: str = "") -> tuple[Reply]:
        return (self._reply(Response(command, opaque, status, text.encode())),)


_Transition = Callable[[ConsumerMachine, Any, float], tuple[Output, ...]]
_TRANSITIONS: dict[type, _Transition] = {
    Mutation: ConsumerMachine._item,
    Deletion: ConsumerMachine._item,
    Expiration: ConsumerMachine._item,
    SnapshotMarker: ConsumerMachine._marker,
    SetVbucketState: ConsumerMachine._set_vbucket_state,
    StreamEnd: ConsumerMachine._stream_end,
    AddStream: ConsumerMachine._add_stream,
    CloseStream: ConsumerMachine._close_stream,
    Noop: ConsumerMachine._noop,
    StreamRequestOk: ConsumerMachine._accepted,
    StreamRequestRollback: ConsumerMachine._roll_back,
    Response: ConsumerMachine._response,
}
"""The transition table: what each event a consumer takes does."""
