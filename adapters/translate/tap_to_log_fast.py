"""The UPR front's ingest fast path: TAP item frames straight to log records.

``decode_frame`` followed by ``TapToUpr.feed`` builds a frozen event with an
``IntFlag`` field and a list per item. For the dominant messages (MUTATION
and DELETE with the 2.x engine-specific rev_seqno) ``item_from_frame``
unpacks the frame with one precompiled struct and hands the fields to the
same translator methods the event path ends in (``TapToUpr.mutation`` and
``TapToUpr.delete``), so both paths log the same records (a property test
holds them together). Anything else (other layouts, frames the decoder
would refuse, control messages) returns None and keeps the event path,
which names what is wrong.

``ack_frame`` is the TAP ack ``encode(TapResponse(opcode, opaque, 0))``
makes, packed in one struct.
"""

from __future__ import annotations

import struct

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import Frame
from adapters.tap.constants import TapOpcode
from adapters.translate.log_records import LogItem
from adapters.translate.tap_to_upr import TapToUpr

# TAP extras of a mutation (engine-specific length, TAP flags, ttl, 3 reserved,
# item flags, expiration), then the engine-specific rev_seqno (and nru)
_MUTATION = struct.Struct(">HHB3xIIQ")
# TAP header of a delete (engine-specific length, TAP flags, ttl, 3 reserved), rev_seqno
_DELETE = struct.Struct(">HHB3xQ")
_RESPONSE_HEADER = struct.Struct(">BBHBBHIIQ")
_REQUEST = Magic.REQUEST.value
_RESPONSE = Magic.RESPONSE.value
OP_MUTATION = TapOpcode.MUTATION.value
OP_DELETE = TapOpcode.DELETE.value
FAST_OPCODES = frozenset({OP_MUTATION, OP_DELETE})
"""Request opcodes ``item_from_frame`` may take."""


def item_from_frame(
    frame: Frame, translator: TapToUpr, now: float
) -> tuple[LogItem | None, int] | None:
    """(log item or None for a duplicate, TAP flags) of a MUTATION or DELETE frame
    of the translator's vbucket, or None when the event path must take it."""
    _, opcode, keylen, _, datatype, _, _, cas, body = frame
    if not keylen:
        return None
    size = len(body)
    if opcode == OP_MUTATION:
        if size < 24:
            return None
        es_len, tap_flags, _, flags, expiration, rev_seqno = _MUTATION.unpack_from(body)
        if es_len != 8 and es_len != 9:
            return None
        key_start = 16 + es_len
        key_end = key_start + keylen
        if key_end > size:
            return None
        item = translator.mutation(
            body[key_start:key_end], body[key_end:], cas, flags, expiration, rev_seqno,
            datatype, tap_flags, now,
        )  # fmt: skip
        return item, tap_flags
    if size < 16:
        return None
    es_len, tap_flags, _, rev_seqno = _DELETE.unpack_from(body)
    if es_len != 8 or 16 + keylen > size:
        return None
    return translator.delete(body[16 : 16 + keylen], cas, rev_seqno, now), tap_flags


def ack_frame(opcode: int, opaque: int) -> bytes:
    """The TAP ack of a request: a response with status 0 and no body."""
    return _RESPONSE_HEADER.pack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0)
