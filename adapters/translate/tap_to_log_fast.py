"""The UPR front's ingest fast path: TAP item frames straight to log records.

``decode_frame`` followed by ``TapToUpr.feed`` builds a frozen event with an
``IntFlag`` field and a list per item. For the dominant messages (MUTATION
and DELETE with the 2.x engine-specific rev_seqno, CHECKPOINT_START/END in
the server layout) ``log_frames`` unpacks a whole run of frames of one
socket read, each with one precompiled struct, and hands the fields to the
same translator methods the event path ends in (``TapToUpr.mutation``,
``.delete``, ``.checkpoint_start``/``_end``), so both paths log the same
records (a property test holds them together). It stops at anything else
(other layouts, frames the decoder would refuse, control messages), which
keeps the event path, which names what is wrong.

``ack_frame`` is the TAP ack ``encode(TapResponse(opcode, opaque, 0))``
makes, packed in one struct.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import Frame
from adapters.tap.constants import TapFlags, TapOpcode
from adapters.translate.log_records import LogItem, LogMark
from adapters.translate.tap_to_upr import TapToUpr

# TAP extras of a mutation (engine-specific length, TAP flags, ttl, 3 reserved,
# item flags, expiration), then the engine-specific rev_seqno (and nru)
_MUTATION = struct.Struct(">HHB3xIIQ")
# The item flags alone in 2.x's little-endian host order (the frame lacks
# NETWORK_BYTE_ORDER): unpacked that way instead of swapped after.
_HOST_FLAGS = struct.Struct("<I")
_NETWORK_BYTE_ORDER = TapFlags.NETWORK_BYTE_ORDER.value
# TAP header of a delete (engine-specific length, TAP flags, ttl, 3 reserved), rev_seqno
_DELETE = struct.Struct(">HHB3xQ")
_RESPONSE_HEADER = struct.Struct(">BBHBBHIIQ")
_REQUEST = Magic.REQUEST.value
_RESPONSE = Magic.RESPONSE.value
OP_MUTATION = TapOpcode.MUTATION.value
OP_DELETE = TapOpcode.DELETE.value
OP_CHECKPOINT_START = TapOpcode.CHECKPOINT_START.value
OP_CHECKPOINT_END = TapOpcode.CHECKPOINT_END.value
_TAP_FLAGS = struct.Struct(">HH")
_ID = struct.Struct(">Q")
FAST_OPCODES = frozenset({OP_MUTATION, OP_DELETE})
"""Item request opcodes ``log_frames`` may take."""


class ItemSink(Protocol):
    """What ``log_frames`` feeds: a vbucket's translator and where its items go."""

    @property
    def translator(self) -> TapToUpr: ...

    def append_item(self, item: LogItem) -> None: ...

    def append_mark(self, mark: LogMark) -> None: ...


S = TypeVar("S", bound=ItemSink)
_ACK = TapFlags.ACK.value


def log_frames(
    frames: Sequence[Frame],
    start: int,
    sinks: Mapping[int, S],
    now: float,
    touched: dict[int, S],
    acks: list[bytes],
) -> int:
    """Log the run of MUTATION/DELETE frames (each unpacked once, straight to its
    log item) and CHECKPOINT_START/END frames of the server layout
    from ``frames[start]``; the index of the first frame it left for the event
    path (``len(frames)``: none), which names what is wrong with a frame.

    Each item goes to its vbucket's sink, the sink into ``touched``, and the
    ack a frame asks for onto ``acks``, in order.
    """
    mutation, delete = _MUTATION.unpack_from, _DELETE.unpack_from
    host_flags = _HOST_FLAGS.unpack_from
    ack = _RESPONSE_HEADER.pack
    for index in range(start, len(frames)):
        magic, opcode, keylen, _, datatype, vbucket, opaque, cas, body = frames[index]
        if magic != _REQUEST or not keylen:
            return index
        sink = sinks.get(vbucket)
        if sink is None:
            return index
        size = len(body)
        if opcode == OP_MUTATION:
            if size < 24:
                return index
            es_len, tap_flags, _, flags, expiration, rev_seqno = mutation(body)
            if es_len != 8 and es_len != 9:
                return index
            key_start = 16 + es_len
            key_end = key_start + keylen
            if key_end > size:
                return index
            given = tap_flags
            if not tap_flags & _NETWORK_BYTE_ORDER:
                flags = host_flags(body, 8)[0]
                given = tap_flags | _NETWORK_BYTE_ORDER
            item = sink.translator.mutation(
                body[key_start:key_end], body[key_end:], cas, flags, expiration, rev_seqno,
                datatype, given, now,
            )  # fmt: skip
        elif opcode == OP_DELETE:
            if size < 16:
                return index
            es_len, tap_flags, _, rev_seqno = delete(body)
            if es_len != 8 or 16 + keylen > size:
                return index
            item = sink.translator.delete(body[16 : 16 + keylen], cas, rev_seqno, now)
        elif opcode in (OP_CHECKPOINT_START, OP_CHECKPOINT_END):
            # The server layout (a key, the id as an 8-byte value): one per live item
            # of a 2.x stream that keeps up, so not worth an event each.
            if size < 16:
                return index
            es_len, tap_flags = _TAP_FLAGS.unpack_from(body)
            key_end = 16 + es_len + keylen
            if key_end > size or size - key_end != 8:
                return index
            checkpoint = _ID.unpack_from(body, key_end)[0]
            translator = sink.translator
            if opcode == OP_CHECKPOINT_START:
                sink.append_mark(translator.checkpoint_start(checkpoint))
            else:
                sink.append_mark(translator.checkpoint_end(checkpoint))
            item = None
        else:
            return index
        if item is not None:
            sink.append_item(item)
        touched[vbucket] = sink
        if tap_flags & _ACK:
            acks.append(ack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0))
    return len(frames)


def ack_frame(opcode: int, opaque: int) -> bytes:
    """The TAP ack of a request: a response with status 0 and no body."""
    return _RESPONSE_HEADER.pack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0)
