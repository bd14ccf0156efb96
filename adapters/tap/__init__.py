"""TAP (ep-engine 2.x replication): events and codec."""

from adapters.tap.codec import TapDecoder, decode_frame, encode, is_tap_opcode
from adapters.tap.constants import (
    DEFAULT_TTL,
    CheckpointLayout,
    ConnectFlags,
    OpaqueCode,
    TapFlags,
    TapOpcode,
)
from adapters.tap.events import (
    TapCheckpoint,
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

__all__ = [
    "DEFAULT_TTL",
    "CheckpointLayout",
    "ConnectFlags",
    "OpaqueCode",
    "TapCheckpoint",
    "TapCheckpointEnd",
    "TapCheckpointStart",
    "TapConnect",
    "TapDecoder",
    "TapDelete",
    "TapEvent",
    "TapFlags",
    "TapFlush",
    "TapMutation",
    "TapNoop",
    "TapNoopResponse",
    "TapOpaque",
    "TapOpcode",
    "TapResponse",
    "TapStreamMessage",
    "TapVbucketSet",
    "decode_frame",
    "encode",
    "is_tap_opcode",
]
