"""TAP opcodes, flags and opaque codes (ep-engine 2.x)."""

from __future__ import annotations

from enum import IntEnum, IntFlag

from adapters.mcbp.constants import VBucketState

__all__ = ["ConnectFlags", "OpaqueCode", "TapFlags", "TapOpcode", "VBucketState"]

DEFAULT_TTL = 255
"""A producer starts every message at TTL 255; each relay decrements it."""


class TapOpcode(IntEnum):
    CONNECT = 0x40
    MUTATION = 0x41
    DELETE = 0x42
    FLUSH = 0x43
    OPAQUE = 0x44
    VBUCKET_SET = 0x45
    CHECKPOINT_START = 0x46
    CHECKPOINT_END = 0x47


class ConnectFlags(IntFlag):
    """CONNECT options; their data travels in the value in bit order."""

    BACKFILL = 0x01
    DUMP = 0x02
    LIST_VBUCKETS = 0x04
    TAKEOVER_VBUCKETS = 0x08
    SUPPORT_ACK = 0x10
    KEYS_ONLY = 0x20
    CHECKPOINT = 0x40
    REGISTERED_CLIENT = 0x80
    FIX_FLAG_BYTEORDER = 0x100


class TapFlags(IntFlag):
    """Per-message flags in the TAP header."""

    ACK = 0x01
    NO_VALUE = 0x02
    NETWORK_BYTE_ORDER = 0x04


NO_TAP_FLAGS = TapFlags(0)
NO_CONNECT_FLAGS = ConnectFlags(0)


class OpaqueCode(IntEnum):
    """Engine-specific code of a TAP OPAQUE message."""

    ENABLE_AUTO_NACK = 0
    INITIAL_VBUCKET_STREAM = 1
    ENABLE_CHECKPOINT_SYNC = 2
    OPEN_CHECKPOINT = 3
    COMPLETE_VB_FILTER_CHANGE = 4
    CLOSE_TAP_STREAM = 7
    CLOSE_BACKFILL = 8


class CheckpointLayout(IntEnum):
    """How a CHECKPOINT_START/END carries its id.

    SERVER: what 2.x servers send, the mutation layout with key
    ``checkpoint_start``/``checkpoint_end`` and the id as an 8-byte value.
    DOCUMENT: the protocol document's form, TAP header extras, no key, 8 bytes.
    """

    SERVER = 0
    DOCUMENT = 1


CHECKPOINT_KEYS = {
    TapOpcode.CHECKPOINT_START: b"checkpoint_start",
    TapOpcode.CHECKPOINT_END: b"checkpoint_end",
}


def swap32(flags: int) -> int:
    """Item flags between network order and 2.x's little-endian host order (either way)."""
    return int.from_bytes(flags.to_bytes(4, "big"), "little")
