"""The two UPR wire dialects, as data.

Theory of operation. Released UPR (DCP, Couchbase 3.0) and the transport
draft that peers older than about May 2014 speak share the memcached framing
and most messages but differ in opcode numbers, in the stream request's
extras (48 bytes with a snapshot range versus 40 with a high seqno and a
group-id key), in the item extras (3.0 adds nmeta and nru), in which
messages exist (the draft has STREAM_START and SNAPSHOT_START/END instead of
SNAPSHOT_MARKER, and no OPEN, CONTROL, NOOP, ...), in the numbering of
vbucket states, and in where a rollback seqno is sent. Every one of those
differences is a field of ``Dialect``; the codec builds its decoder and
encoder tables from these fields once and never asks which dialect it is in.

Not a difference: STREAM_END reasons. The draft's prose lists "state
changed" as 0x01, but the PROTOCOL-NOTES record no such split and servers
numbered ok, closed, state changed, disconnected from the start, so reasons
pass through unchanged in both dialects.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from adapters.upr.constants import Command, VBucketState


@dataclass(frozen=True, slots=True)
class ItemLayout:
    """One extras layout of MUTATION, DELETION or EXPIRATION.

    Every layout starts with by_seqno u64, rev_seqno u64; a mutation layout
    follows with item flags, expiration and lock time (u32 each).
    ``meta``: the layout ends with nmeta u16 (and nru u8 on a mutation), and
    nmeta bytes of metadata end the body. ``delete_time``: a u32 deletion
    time follows the seqnos (and any pad bytes after it are in ``extras``).
    """

    extras: struct.Struct
    meta: bool = False
    delete_time: bool = False

    @property
    def size(self) -> int:
        return self.extras.size


@dataclass(frozen=True, slots=True)
class StreamRequestLayout:
    """STREAM_REQ extras: flags u32, reserved u32, start, end, vbucket uuid, then
    either the snapshot range (two u64) or the high seqno (one u64)."""

    extras: struct.Struct
    snapshot_range: bool
    group_id: bool
    """The key may carry a group id (draft); otherwise a key is malformed."""


@dataclass(frozen=True, eq=False)
class Dialect:
    """Everything that differs between the UPR dialects.

    Compared by identity: the codec caches its tables per dialect object.
    """

    name: str
    opcodes: Mapping[Command, int]
    """The commands this dialect has, and their opcodes."""
    stream_request: StreamRequestLayout
    mutation: ItemLayout
    deletion: tuple[ItemLayout, ...]
    """Accepted DELETION layouts; encoding picks by ``delete_time`` presence."""
    expiration: tuple[ItemLayout, ...]
    state_to_wire: Mapping[VBucketState, int]
    rollback_in_extras: bool
    """Where this dialect sends a rollback seqno (decoding accepts either place)."""
    commands: Mapping[int, Command] = field(init=False)
    state_from_wire: Mapping[int, VBucketState] = field(init=False)

    def __post_init__(self) -> None:
        # Derived reverse maps, built once; frozen, hence object.__setattr__.
        commands = {opcode: command for command, opcode in self.opcodes.items()}
        states = {wire: state for state, wire in self.state_to_wire.items()}
        if len(commands) != len(self.opcodes) or len(states) != len(self.state_to_wire):
            raise ValueError(f"dialect {self.name}: opcode or state map is not one-to-one")
        object.__setattr__(self, "commands", MappingProxyType(commands))
        object.__setattr__(self, "state_from_wire", MappingProxyType(states))

    def __repr__(self) -> str:
        return f"Dialect({self.name!r})"


C = Command

DCP = Dialect(
    name="dcp",
    opcodes=MappingProxyType(
        {
            C.OPEN: 0x50,
            C.ADD_STREAM: 0x51,
            C.CLOSE_STREAM: 0x52,
            C.STREAM_REQ: 0x53,
            C.GET_FAILOVER_LOG: 0x54,
            C.STREAM_END: 0x55,
            C.SNAPSHOT_MARKER: 0x56,
            C.MUTATION: 0x57,
            C.DELETION: 0x58,
            C.EXPIRATION: 0x59,
            C.FLUSH: 0x5A,
            C.SET_VBUCKET_STATE: 0x5B,
            C.NOOP: 0x5C,
            C.BUFFER_ACKNOWLEDGEMENT: 0x5D,
            C.CONTROL: 0x5E,
        }
    ),
    stream_request=StreamRequestLayout(
        struct.Struct(">IIQQQQQ"), snapshot_range=True, group_id=False
    ),
    mutation=ItemLayout(struct.Struct(">QQIIIHB"), meta=True),
    # 18: what 3.0 sends. 21/20: what consumers that asked for delete times
    # (and the expiry opcode) receive; strict clients assert these lengths.
    deletion=(
        ItemLayout(struct.Struct(">QQH"), meta=True),
        ItemLayout(struct.Struct(">QQIx"), delete_time=True),
    ),
    expiration=(
        ItemLayout(struct.Struct(">QQH"), meta=True),
        ItemLayout(struct.Struct(">QQI"), delete_time=True),
    ),
    # Engine order on the wire (what servers send since 4.5 and what TAP uses).
    state_to_wire=MappingProxyType(
        {
            VBucketState.ACTIVE: 1,
            VBucketState.REPLICA: 2,
            VBucketState.PENDING: 3,
            VBucketState.DEAD: 4,
        }
    ),
    rollback_in_extras=False,
)
"""Released UPR as Couchbase 3.0 speaks it."""

UPR_DRAFT = Dialect(
    name="upr-draft",
    opcodes=MappingProxyType(
        {
            C.STREAM_REQ: 0x50,
            C.GET_FAILOVER_LOG: 0x51,
            C.STREAM_START: 0x52,
            C.STREAM_END: 0x53,
            C.SNAPSHOT_START: 0x54,
            C.SNAPSHOT_END: 0x55,
            C.MUTATION: 0x56,
            C.DELETION: 0x57,
            C.EXPIRATION: 0x58,
            C.FLUSH: 0x59,
            C.SET_VBUCKET_STATE: 0x5A,
        }
    ),
    stream_request=StreamRequestLayout(
        struct.Struct(">IIQQQQ"), snapshot_range=False, group_id=True
    ),
    mutation=ItemLayout(struct.Struct(">QQIII")),
    deletion=(ItemLayout(struct.Struct(">QQ")),),
    expiration=(ItemLayout(struct.Struct(">QQ")),),
    # The transport draft numbers pending 2 and replica 3.
    state_to_wire=MappingProxyType(
        {
            VBucketState.ACTIVE: 1,
            VBucketState.PENDING: 2,
            VBucketState.REPLICA: 3,
            VBucketState.DEAD: 4,
        }
    ),
    rollback_in_extras=True,
)
"""The pre-release "UPR Transport Specification" draft, spoken by pre-May-2014 peers."""

DIALECTS: Mapping[str, Dialect] = MappingProxyType({d.name: d for d in (DCP, UPR_DRAFT)})


def get_dialect(name: str) -> Dialect:
    """``"dcp"`` or ``"upr-draft"``; anything else is a ``ValueError``."""
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(
            f"unknown UPR dialect {name!r} (expected one of {', '.join(DIALECTS)})"
        ) from None
