"""TAP events: one frozen class per message.

Messages a producer sends carry the TAP header fields ``tap_flags`` and
``ttl``; ``rev_seqno``/``nru`` are the 2.x engine-specific metadata (``None``
when a message carries none). A client answers with ``TapResponse``: status 0
is an ack, anything else a nack (optionally with text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from adapters.mcbp.constants import VBucketState
from adapters.tap.constants import (
    DEFAULT_TTL,
    NO_CONNECT_FLAGS,
    NO_TAP_FLAGS,
    CheckpointLayout,
    ConnectFlags,
    OpaqueCode,
    TapFlags,
    TapOpcode,
)


@dataclass(frozen=True, slots=True)
class TapConnect:
    """Client -> server: open a TAP stream. No response on success."""

    NAME: ClassVar[str] = "CONNECT"
    IS_RESPONSE: ClassVar[bool] = False
    name: bytes
    connect_flags: ConnectFlags = NO_CONNECT_FLAGS
    backfill_date: int | None = None
    """Epoch seconds; 0 or past = everything, future (e.g. all ones) = new changes only."""
    vbuckets: tuple[int, ...] = ()
    checkpoints: tuple[tuple[int, int], ...] = ()
    """(vbucket, last closed checkpoint id) pairs, with the CHECKPOINT flag."""
    registered_byte: int | None = None
    opaque: int = 0


@dataclass(frozen=True, slots=True)
class TapMutation:
    NAME: ClassVar[str] = "MUTATION"
    IS_RESPONSE: ClassVar[bool] = False
    key: bytes
    value: bytes = b""
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    flags: int = 0
    """Item flags as they travel (see ``TapFlags.NETWORK_BYTE_ORDER``)."""
    expiration: int = 0
    rev_seqno: int | None = None
    nru: int | None = None
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL
    datatype: int = 0


@dataclass(frozen=True, slots=True)
class TapDelete:
    """A deletion; TAP has no expiration message, an expiry travels as this."""

    NAME: ClassVar[str] = "DELETE"
    IS_RESPONSE: ClassVar[bool] = False
    key: bytes
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    rev_seqno: int | None = None
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL


@dataclass(frozen=True, slots=True)
class TapFlush:
    NAME: ClassVar[str] = "FLUSH"
    IS_RESPONSE: ClassVar[bool] = False
    vbucket: int = 0
    opaque: int = 0
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL


@dataclass(frozen=True, slots=True)
class TapOpaque:
    NAME: ClassVar[str] = "OPAQUE"
    IS_RESPONSE: ClassVar[bool] = False
    opaque_code: OpaqueCode | int
    vbucket: int = 0
    opaque: int = 0
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL
    engine_specific_length: int = 4
    """The code is these 4 bytes; with any other length it means nothing (2.5.1
    logged such an OPAQUE and went on), and ``opaque_code`` holds the 4 bytes
    after the TAP header as they came, or 0 when the body ends first."""


@dataclass(frozen=True, slots=True)
class TapVbucketSet:
    NAME: ClassVar[str] = "VBUCKET_SET"
    IS_RESPONSE: ClassVar[bool] = False
    state: VBucketState
    vbucket: int = 0
    opaque: int = 0
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL


@dataclass(frozen=True, slots=True)
class TapCheckpointStart:
    NAME: ClassVar[str] = "CHECKPOINT_START"
    IS_RESPONSE: ClassVar[bool] = False
    checkpoint_id: int
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL
    layout: CheckpointLayout = CheckpointLayout.SERVER
    engine_specific: bytes = b""
    """Metadata a server layout may carry; relayed, not interpreted."""


@dataclass(frozen=True, slots=True)
class TapCheckpointEnd:
    NAME: ClassVar[str] = "CHECKPOINT_END"
    IS_RESPONSE: ClassVar[bool] = False
    checkpoint_id: int
    vbucket: int = 0
    opaque: int = 0
    cas: int = 0
    tap_flags: TapFlags = NO_TAP_FLAGS
    ttl: int = DEFAULT_TTL
    layout: CheckpointLayout = CheckpointLayout.SERVER
    engine_specific: bytes = b""


@dataclass(frozen=True, slots=True)
class TapResponse:
    """A response to a TAP message: an ack (status 0) or a nack.

    Also how a server refuses a CONNECT (opcode CONNECT, status 0x83)."""

    NAME: ClassVar[str] = "RESPONSE"
    IS_RESPONSE: ClassVar[bool] = True
    opcode: TapOpcode
    opaque: int = 0
    status: int = 0
    text: bytes = b""

    @property
    def is_ack(self) -> bool:
        return self.status == 0


@dataclass(frozen=True, slots=True)
class TapNoop:
    """Plain memcached NOOP, the keep-alive of an idle TAP stream."""

    NAME: ClassVar[str] = "NOOP"
    IS_RESPONSE: ClassVar[bool] = False
    opaque: int = 0


@dataclass(frozen=True, slots=True)
class TapNoopResponse:
    NAME: ClassVar[str] = "NOOP"
    IS_RESPONSE: ClassVar[bool] = True
    opaque: int = 0
    status: int = 0


TapCheckpoint = TapCheckpointStart | TapCheckpointEnd

TapStreamMessage = (
    TapMutation
    | TapDelete
    | TapFlush
    | TapOpaque
    | TapVbucketSet
    | TapCheckpointStart
    | TapCheckpointEnd
)
"""What a producer sends inside a TAP stream (each has tap_flags, ttl, opaque)."""

TapEvent = TapConnect | TapStreamMessage | TapResponse | TapNoop | TapNoopResponse


@dataclass(frozen=True, slots=True)
class EncodedTapFrame:
    """A stream message kept as the frame it was sent as (the fast path's items).

    ``opaque`` and ``tap_flags`` are what the frame must carry when sent
    again: encoding writes them into a copy of ``frame`` (a retransmit, or an
    ack request added to the last message of a batch)."""

    NAME: ClassVar[str] = "ENCODED"
    IS_RESPONSE: ClassVar[bool] = False
    frame: bytes
    vbucket: int = 0
    opaque: int = 0
    tap_flags: int = 0


Stamped = TapStreamMessage | EncodedTapFrame
"""What a TAP producer keeps until acked: a message, or the frame it was sent as."""
