"""UPR events: one frozen class per message, the same in both dialects.

Requests carry ``opaque`` and ``vbucket`` (the header fields); responses carry
``opaque`` and ``status``. Item messages also keep the header's ``cas`` and
``datatype``. Field names are the protocol's, so a dissector can print
``dataclasses.fields`` as they are.

Responses live in ``responses``; ``UprEvent`` here is the union of both.

Values are dialect-neutral: a vbucket state is always in the engine's order,
a stream request has both the released snapshot range and the draft's high
seqno (each dialect can send only its own, the others must stay 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from adapters.upr.constants import (
    NO_OPEN_FLAGS,
    NO_SNAPSHOT_FLAGS,
    NO_STREAM_FLAGS,
    Command,
    OpenFlags,
    SnapshotFlags,
    StreamEndReason,
    StreamFlags,
    VBucketState,
)
from adapters.upr.responses import (
    AddStreamResponse,
    FailoverLogResponse,
    Response,
    StreamRequestOk,
    StreamRequestRollback,
)

# --- connection and stream set-up ------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Open a named UPR connection (released dialect only)."""

    NAME: ClassVar[str] = "OPEN"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.OPEN
    name: bytes
    flags: OpenFlags = NO_OPEN_FLAGS
    seqno: int = 0
    """The reserved u32 ahead of the flags (older documents call it a seqno)."""
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class AddStream:
    """Ask a consumer connection to open a stream for ``vbucket``."""

    NAME: ClassVar[str] = "ADD_STREAM"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.ADD_STREAM
    flags: StreamFlags = NO_STREAM_FLAGS
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class CloseStream:
    NAME: ClassVar[str] = "CLOSE_STREAM"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.CLOSE_STREAM
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """Consumer -> producer: stream ``vbucket`` from ``start_seqno``.

    The released form carries the snapshot range to resume in; the draft
    carries ``high_seqno`` and an optional group id (``name``) instead.
    """

    NAME: ClassVar[str] = "STREAM_REQ"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.STREAM_REQ
    flags: StreamFlags = NO_STREAM_FLAGS
    start_seqno: int = 0
    end_seqno: int = 0
    vbucket_uuid: int = 0
    snap_start_seqno: int = 0
    snap_end_seqno: int = 0
    high_seqno: int = 0
    name: bytes = b""
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class GetFailoverLog:
    NAME: ClassVar[str] = "GET_FAILOVER_LOG"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.GET_FAILOVER_LOG
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Control:
    """Connection setting, e.g. ``connection_buffer_size``; ``key`` is never empty."""

    NAME: ClassVar[str] = "CONTROL"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.CONTROL
    key: bytes
    value: bytes = b""
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Noop:
    NAME: ClassVar[str] = "NOOP"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.NOOP
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class BufferAcknowledgement:
    """Consumer -> producer: ``buffer_bytes`` of the flow-control window were freed."""

    NAME: ClassVar[str] = "BUFFER_ACKNOWLEDGEMENT"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.BUFFER_ACKNOWLEDGEMENT
    buffer_bytes: int = 0
    opaque: int = 0
    vbucket: int = 0


# --- stream messages (producer -> consumer) ---------------------------------


@dataclass(frozen=True, slots=True)
class StreamStart:
    """Draft only: the stream begins."""

    NAME: ClassVar[str] = "STREAM_START"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.STREAM_START
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The stream is over; ``reason`` keeps unknown values as plain ints."""

    NAME: ClassVar[str] = "STREAM_END"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.STREAM_END
    reason: StreamEndReason | int = StreamEndReason.OK
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotMarker:
    """Released dialect: the items up to ``end_seqno`` form one snapshot."""

    NAME: ClassVar[str] = "SNAPSHOT_MARKER"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.SNAPSHOT_MARKER
    start_seqno: int = 0
    end_seqno: int = 0
    flags: SnapshotFlags = NO_SNAPSHOT_FLAGS
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotStart:
    """Draft only: a snapshot begins (no range travels)."""

    NAME: ClassVar[str] = "SNAPSHOT_START"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.SNAPSHOT_START
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotEnd:
    """Draft only: the current snapshot is complete."""

    NAME: ClassVar[str] = "SNAPSHOT_END"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.SNAPSHOT_END
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Mutation:
    """An item's new value. ``meta`` is the trailing metadata (nmeta bytes, 3.0 only)."""

    NAME: ClassVar[str] = "MUTATION"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.MUTATION
    key: bytes
    value: bytes = b""
    by_seqno: int = 0
    rev_seqno: int = 0
    flags: int = 0
    """Item flags as stored (they travel in network order, uninterpreted)."""
    expiration: int = 0
    lock_time: int = 0
    nru: int = 0
    meta: bytes = b""
    cas: int = 0
    datatype: int = 0
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Deletion:
    """An item was deleted.

    ``delete_time`` is ``None`` for the 3.0 layout (by_seqno, rev_seqno,
    nmeta) and an int for the newer one that carries the time of deletion;
    encoding keeps whichever layout the event came in. ``value`` is whatever
    sits between the key and the metadata (nothing, from a 3.0 server).
    """

    NAME: ClassVar[str] = "DELETION"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.DELETION
    key: bytes
    by_seqno: int = 0
    rev_seqno: int = 0
    meta: bytes = b""
    delete_time: int | None = None
    value: bytes = b""
    cas: int = 0
    datatype: int = 0
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Expiration:
    """An item expired; same fields and layouts as ``Deletion``."""

    NAME: ClassVar[str] = "EXPIRATION"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.EXPIRATION
    key: bytes
    by_seqno: int = 0
    rev_seqno: int = 0
    meta: bytes = b""
    delete_time: int | None = None
    value: bytes = b""
    cas: int = 0
    datatype: int = 0
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class Flush:
    NAME: ClassVar[str] = "FLUSH"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.FLUSH
    opaque: int = 0
    vbucket: int = 0


@dataclass(frozen=True, slots=True)
class SetVbucketState:
    """Takeover hand-off; ``state`` is in the engine's order whatever the dialect."""

    NAME: ClassVar[str] = "SET_VBUCKET_STATE"
    IS_RESPONSE: ClassVar[bool] = False
    COMMAND: ClassVar[Command] = Command.SET_VBUCKET_STATE
    state: VBucketState
    opaque: int = 0
    vbucket: int = 0


UprRequest = (
    Open
    | AddStream
    | CloseStream
    | StreamRequest
    | GetFailoverLog
    | Control
    | Noop
    | BufferAcknowledgement
    | StreamStart
    | StreamEnd
    | SnapshotMarker
    | SnapshotStart
    | SnapshotEnd
    | Mutation
    | Deletion
    | Expiration
    | Flush
    | SetVbucketState
)

UprResponse = (
    StreamRequestOk | StreamRequestRollback | FailoverLogResponse | AddStreamResponse | Response
)

UprEvent = UprRequest | UprResponse

REQUEST_CLASSES: dict[Command, type[UprRequest]] = {
    cls.COMMAND: cls
    for cls in (
        Open,
        AddStream,
        CloseStream,
        StreamRequest,
        GetFailoverLog,
        Control,
        Noop,
        BufferAcknowledgement,
        StreamStart,
        StreamEnd,
        SnapshotMarker,
        SnapshotStart,
        SnapshotEnd,
        Mutation,
        Deletion,
        Expiration,
        Flush,
        SetVbucketState,
    )
}
"""The request event class of every command."""
