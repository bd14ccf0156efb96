"""UPR (DCP) enumerations that do not depend on the dialect.

``Command`` names every kind of UPR message independently of its opcode: the
two dialects give different opcodes to the same command (STREAM_REQ is 0x53
in released DCP and 0x50 in the transport draft), so events and generic
responses carry a ``Command``, and each dialect maps it to its opcode.

Vbucket states are the engine's order everywhere above the wire; a dialect
maps them to its own wire numbers.
"""

from __future__ import annotations

from enum import Enum, IntEnum, IntFlag

from adapters.mcbp.constants import VBucketState

__all__ = [
    "Command",
    "OpenFlags",
    "SnapshotFlags",
    "StreamEndReason",
    "StreamFlags",
    "StreamState",
    "VBucketState",
]


class Command(IntEnum):
    """Every UPR message kind, dialect-neutral (the values are not opcodes)."""

    OPEN = 1
    ADD_STREAM = 2
    CLOSE_STREAM = 3
    STREAM_REQ = 4
    GET_FAILOVER_LOG = 5
    STREAM_END = 6
    SNAPSHOT_MARKER = 7
    MUTATION = 8
    DELETION = 9
    EXPIRATION = 10
    FLUSH = 11
    SET_VBUCKET_STATE = 12
    NOOP = 13
    BUFFER_ACKNOWLEDGEMENT = 14
    CONTROL = 15
    # Only in the transport draft: stream start and separate snapshot start/end.
    STREAM_START = 16
    SNAPSHOT_START = 17
    SNAPSHOT_END = 18


class OpenFlags(IntFlag):
    """OPEN connection flags; no flag at all opens a consumer."""

    PRODUCER = 0x01
    NOTIFIER = 0x02
    INCLUDE_XATTRS = 0x04
    NO_VALUE = 0x08
    INCLUDE_DELETE_TIMES = 0x20


class StreamFlags(IntFlag):
    """ADD_STREAM and STREAM_REQ flags."""

    TAKEOVER = 0x01
    DISK_ONLY = 0x02
    LATEST = 0x04


class SnapshotFlags(IntFlag):
    """SNAPSHOT_MARKER flags; with ACK set the consumer answers after the snapshot's end."""

    MEMORY = 0x01
    DISK = 0x02
    CHECKPOINT = 0x04
    ACK = 0x08


class StreamEndReason(IntEnum):
    """Why a producer ended a stream (STREAM_END extras)."""

    OK = 0
    CLOSED = 1
    STATE_CHANGED = 2
    DISCONNECTED = 3
    TOO_SLOW = 4
    BACKFILL_FAILED = 5
    ROLLBACK = 6
    FILTER_EMPTY = 7
    LOST_PRIVILEGES = 8


NO_OPEN_FLAGS = OpenFlags(0)
NO_STREAM_FLAGS = StreamFlags(0)
NO_SNAPSHOT_FLAGS = SnapshotFlags(0)


class StreamState(Enum):
    """A producer stream's state, as 3.0 reports it in
    ``eq_dcpq:<name>:stream_<vb>_state`` (ep-engine v3.0.0 ``Stream::stateName``)."""

    PENDING = "pending"
    BACKFILLING = "backfilling"
    IN_MEMORY = "in-memory"
    TAKEOVER_SEND = "takeover-send"
    TAKEOVER_WAIT = "takeover-wait"
    DEAD = "dead"
