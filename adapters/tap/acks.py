"""The TAP ack: which opcode answers which stream message.

A TAP receiver answers a message that asks for an ack (or one it refuses)
with a response of the message's own opcode and opaque (memcached 2.x
daemon/memcached.c ``process_bin_tap_packet``; ep-engine's
tapconnection.cc ``TapProducer::processAck`` reads them); a nack carries a
status and a text. One map for every receiver here: the
reference node, the UPR front's ingest, capture and the test clients.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from adapters.tap import (
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapStreamMessage,
    TapVbucketSet,
    encode,
)

ACK_OPCODES: Mapping[type, TapOpcode] = MappingProxyType(
    {
        TapMutation: TapOpcode.MUTATION,
        TapDelete: TapOpcode.DELETE,
        TapFlush: TapOpcode.FLUSH,
        TapOpaque: TapOpcode.OPAQUE,
        TapVbucketSet: TapOpcode.VBUCKET_SET,
        TapCheckpointStart: TapOpcode.CHECKPOINT_START,
        TapCheckpointEnd: TapOpcode.CHECKPOINT_END,
    }
)
"""The opcode of each stream message, which its ack repeats."""


def ack_opcode(message: TapStreamMessage) -> TapOpcode:
    return ACK_OPCODES[type(message)]


def ack_of(message: TapStreamMessage, status: int = 0, text: bytes = b"") -> bytes:
    """The ack of ``message`` (status 0) or, with a status, its nack."""
    return encode(TapResponse(ACK_OPCODES[type(message)], message.opaque, status, text))
