"""The TAP front's fast path: UPR items straight to TAP frame bytes.

``UprToTap.feed`` followed by ``TapProducer.stamp`` and the TAP codec makes
three objects and several joins per item. For the dominant messages
(MUTATION, DELETION, EXPIRATION) ``encode_item`` packs the TAP frame a 2.x
server would send in one precompiled struct and one join, from the decoded
UPR item, the translator's settings and the stamp (sequence number and TAP
flags from ``TapProducer.next_stamp``). The result is byte for byte what
the event path sends (a property test holds the two paths together); every
other message keeps the event path.
"""

from __future__ import annotations

import struct

from adapters.mcbp.constants import HEADER_SIZE, Magic
from adapters.mcbp.frames import Frame
from adapters.tap.constants import DEFAULT_TTL, TapOpcode, swap32
from adapters.tap.events import EncodedTapFrame
from adapters.tap.producer import TapProducer
from adapters.translate.upr_to_tap import UprToTap
from adapters.upr.events import Deletion, Expiration, Mutation

# header, TAP extras (engine-specific length, TAP flags, ttl, 3 reserved,
# item flags, expiration), then the engine-specific rev_seqno and nru
_MUTATION = struct.Struct(">BBHBBHIIQHHB3xIIQB")
_MUTATION_FIXED = _MUTATION.size - HEADER_SIZE
# header, TAP extras (engine-specific length, TAP flags, ttl, 3 reserved), rev_seqno
_DELETE = struct.Struct(">BBHBBHIIQHHB3xQ")
_DELETE_FIXED = _DELETE.size - HEADER_SIZE
_REQUEST = Magic.REQUEST.value
_OP_MUTATION = TapOpcode.MUTATION.value
_OP_DELETE = TapOpcode.DELETE.value


def mutation_frame(item: Mutation, translator: UprToTap, opaque: int, tap_flags: int) -> bytes:
    """The stamped TAP MUTATION of ``item``, as ``UprToTap`` then ``encode`` make it."""
    key = item.key
    value = b"" if translator.keys_only else item.value
    head = _MUTATION.pack(
        _REQUEST, _OP_MUTATION, len(key), 16, item.datatype, translator.vbucket,
        _MUTATION_FIXED + len(key) + len(value), opaque, item.cas,
        9, tap_flags, DEFAULT_TTL,
        item.flags if translator.network_byte_order else swap32(item.flags),
        item.expiration, item.rev_seqno, item.nru,
    )  # fmt: skip
    return b"".join((head, key, value))


def delete_frame(
    item: Deletion | Expiration, translator: UprToTap, opaque: int, tap_flags: int
) -> bytes:
    """The stamped TAP DELETE of a deletion or expiration."""
    key = item.key
    head = _DELETE.pack(
        _REQUEST, _OP_DELETE, len(key), 8, 0, translator.vbucket,
        _DELETE_FIXED + len(key), opaque, item.cas,
        8, tap_flags, DEFAULT_TTL, item.rev_seqno,
    )  # fmt: skip
    return head + key


def stamped_item(
    item: Mutation | Deletion | Expiration, translator: UprToTap, producer: TapProducer
) -> bytes:
    """Stamp and encode one item after ``translator.advance`` took its seqno; the
    producer keeps the frame for acks and retransmits as ``stamp`` keeps a message."""
    if type(item) is Mutation:
        opaque, flags = producer.next_stamp(translator.item_flags)
        data = mutation_frame(item, translator, opaque, flags)
    else:
        opaque, flags = producer.next_stamp(0)
        data = delete_frame(item, translator, opaque, flags)  # type: ignore[arg-type]
    producer.keep(EncodedTapFrame(data, translator.vbucket, opaque, flags))
    return data


# The released dialect's item layouts (``adapters.upr.dialect.DCP``): a mutation's
# by_seqno, rev_seqno, flags, expiration, lock_time, nmeta, nru; a 3.0 deletion's
# or expiration's by_seqno, rev_seqno, nmeta.
_DCP_MUTATION = struct.Struct(">QQIIIHB")
_DCP_REMOVAL = struct.Struct(">QQH")
DCP_MUTATION = 0x57
DCP_DELETION = 0x58
DCP_EXPIRATION = 0x59
FAST_OPCODES = frozenset({DCP_MUTATION, DCP_DELETION, DCP_EXPIRATION})
"""Released-dialect request opcodes ``item_from_frame`` may take."""


def item_from_frame(
    frame: Frame, translator: UprToTap, producer: TapProducer
) -> tuple[bytes, int, bool] | None:
    """A released-dialect item frame straight to its stamped TAP frame.

    Returns (TAP frame, by_seqno, whether it ends the open snapshot), or None
    for a frame the event path must take (another layout, or one the decoder
    would refuse: it then names what is wrong). The frame must be a request
    whose opcode is in ``FAST_OPCODES``; the producer must have room.
    """
    _, opcode, keylen, extlen, datatype, _, _, cas, body = frame
    if not keylen:
        return None
    if opcode == DCP_MUTATION:
        if extlen != 31:
            return None
        by_seqno, rev_seqno, flags, expiration, _, nmeta, nru = _DCP_MUTATION.unpack_from(body)
        key_end = 31 + keylen
        value_end = len(body) - nmeta
        if value_end < key_end:
            return None
        closes = translator.advance(by_seqno)
        tap_flags = translator.item_flags
        opaque, tap_flags = producer.next_stamp(tap_flags)
        value = b"" if translator.keys_only else body[key_end:value_end]
        head = _MUTATION.pack(
            _REQUEST, _OP_MUTATION, keylen, 16, datatype, translator.vbucket,
            _MUTATION_FIXED + keylen + len(value), opaque, cas,
            9, tap_flags, DEFAULT_TTL,
            flags if translator.network_byte_order else swap32(flags),
            expiration, rev_seqno, nru,
        )  # fmt: skip
        data = b"".join((head, body[31:key_end], value))
    else:
        if extlen != 18:
            return None
        by_seqno, rev_seqno, nmeta = _DCP_REMOVAL.unpack_from(body)
        if len(body) - nmeta < 18 + keylen:
            return None
        closes = translator.advance(by_seqno)
        opaque, tap_flags = producer.next_stamp(0)
        head = _DELETE.pack(
            _REQUEST, _OP_DELETE, keylen, 8, 0, translator.vbucket,
            _DELETE_FIXED + keylen, opaque, cas,
            8, tap_flags, DEFAULT_TTL, rev_seqno,
        )  # fmt: skip
        data = head + body[18 : 18 + keylen]
    producer.keep(EncodedTapFrame(data, translator.vbucket, opaque, tap_flags))
    return data, by_seqno, closes
