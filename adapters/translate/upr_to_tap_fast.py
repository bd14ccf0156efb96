"""The TAP front's fast path: UPR items straight to TAP frame bytes.

``UprToTap.feed`` followed by ``TapProducer.stamp`` and the TAP codec makes
three objects and several joins per item. For the dominant messages
(MUTATION, DELETION, EXPIRATION) ``mutation_frame`` and ``delete_frame``
pack the TAP frame a 2.x server would send (datatype 0, as ``item_messages``
says) in one precompiled struct and one join, from the decoded UPR item, the
translator's settings and the stamp (sequence number and TAP flags from
``TapProducer.next_stamp``).
The result is byte for byte what the event path sends (a property test holds
the two paths together); every other message keeps the event path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from adapters.mcbp.constants import HEADER_SIZE, Magic
from adapters.mcbp.frames import HEADER, Frame
from adapters.tap.constants import (
    CHECKPOINT_KEYS,
    DEFAULT_TTL,
    OpaqueCode,
    TapFlags,
    TapOpcode,
    swap32,
)
from adapters.tap.producer import TapProducer
from adapters.translate.upr_to_tap import NO_CHECKPOINT, UprToTap
from adapters.upr.constants import SnapshotFlags
from adapters.upr.events import Deletion, Expiration, Mutation

# header, TAP extras (engine-specific length, TAP flags, ttl, 3 reserved,
# item flags, expiration), then the engine-specific rev_seqno and nru
_MUTATION = struct.Struct(">BBHBBHIIQHHB3xIIQB")
_MUTATION_FIXED = _MUTATION.size - HEADER_SIZE
# header, TAP extras (engine-specific length, TAP flags, ttl, 3 reserved), rev_seqno
_DELETE = struct.Struct(">BBHBBHIIQHHB3xQ")
_DELETE_FIXED = _DELETE.size - HEADER_SIZE
_REQUEST = Magic.REQUEST.value
_ACK = TapFlags.ACK.value
_NOT_ACK = ~_ACK
_SEQNO_LIMIT = 1 << 32
_OP_MUTATION = TapOpcode.MUTATION.value
_OP_DELETE = TapOpcode.DELETE.value


def mutation_frame(item: Mutation, translator: UprToTap, opaque: int, tap_flags: int) -> bytes:
    """The stamped TAP MUTATION of ``item``, as ``UprToTap`` then ``encode`` make it."""
    key = item.key
    value = b"" if translator.keys_only else item.value
    head = _MUTATION.pack(
        _REQUEST, _OP_MUTATION, len(key), 16, 0, translator.vbucket,
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
    producer.keep(data)
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
    _, opcode, keylen, extlen, _, _, _, cas, body = frame
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
            _REQUEST, _OP_MUTATION, keylen, 16, 0, translator.vbucket,
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
    producer.keep(data)
    return data, by_seqno, closes


# -- whole socket reads ----------------------------------------------------------

# A released-dialect mutation's header and extras in one unpack.
_DCP_MUTATION_HEAD = struct.Struct(">BBHBBHIIQQQIIIHB")
_DCP_MUTATION_END = _DCP_MUTATION_HEAD.size
_DCP_REMOVAL_EXTRAS = 18
_DCP_SNAPSHOT_MARKER = 0x56
_REMOVALS = (DCP_DELETION, DCP_EXPIRATION)
_DCP_MARKER = struct.Struct(">QQI")
# Markers ``translate_items`` leaves to the session: one awaiting a reply, and
# a disk snapshot (the vbucket's backfill progress follows it there).
_INLINE_MARKER_NOT = SnapshotFlags.ACK.value | SnapshotFlags.DISK.value


def translate_items(
    buf: bytes | bytearray,
    offset: int,
    streams: dict[int, UprToTap],
    producer: TapProducer,
    out: list[bytes],
    touched: dict[int, UprToTap],
    closed: list[int] | None = None,
) -> tuple[int, int, int, int, int, UprToTap | None]:
    """``item_from_frame`` over the run of item frames of ``buf`` from ``offset``,
    with no object per item but the TAP frame (appended to ``out``, and kept by
    the producer for acks and resends).

    ``streams`` maps a stream's opaque to its translator (only streams whose
    items may go this way). Stops before a frame the event path must take
    (another message, an incomplete frame, a stream not in ``streams``, a
    seqno that does not grow) and when the producer has no room. Without
    ``closed`` it also stops before any snapshot marker and after an item that
    ends its snapshot (which ``close_frame`` then closes), unless that snapshot
    closes unsaid (``NO_CHECKPOINT``: closed here). With ``closed`` the
    run goes on through what a live stream sends between items: a marker that
    ``marker_frame`` would take (neither ACK nor DISK flagged) becomes its
    CHECKPOINT_START (or nothing, without checkpoint sync), and the snapshot an
    item ends is closed as ``close_frame`` closes it, each checkpoint closed
    adding (vbucket, checkpoint id, last seqno) to ``closed``; it returns a
    closing translator only when no room was left for the close. Returns
    (offset reached, flow-control bytes of the frames taken, mutations,
    deletions, checkpoint messages made, the translator whose snapshot the
    last item ended or None); every translator that took a frame is in
    ``touched`` by vbucket.
    """
    end = len(buf)
    room = producer.room
    # ``TapProducer.next_stamp``, inline: the room taken above keeps every stamp
    # within the window; ``end_run`` hands the producer its state back.
    next_seqno, since, ack_interval = producer.begin_run()
    control_flags = _ACK if ack_interval else 0  # a control message always asks for an ack
    append = out.append
    first_out = len(out)
    swapped = _SWAPPED
    markers_too = closed is not None
    # A backfill comes in runs of one vbucket's items, most with the same flags:
    # the lookups of the item before serve again.
    last_opaque = last_flags = -1
    last_swapped = 0
    translator = last_touched = None
    # Key and value go from a view into the new frame: one copy, not two. (Each
    # slice of it dies with its statement, so the view releases before ``buf``
    # may grow again.)
    with memoryview(buf) as view:
        credit = mutations = deletions = markers = 0
        closing = None
        while room > 0 and end - offset >= HEADER_SIZE:
            if end - offset >= _DCP_MUTATION_END:
                # (a mutation is longer: a shorter buffer cannot hold one whole)
                (magic, opcode, keylen, extlen, _, _, bodylen, opaque, cas,
                 by_seqno, rev_seqno, flags, expiration, _, nmeta, nru,
                 ) = _DCP_MUTATION_HEAD.unpack_from(buf, offset)  # fmt: skip
            else:
                magic, opcode, keylen, extlen, _, _, bodylen, opaque, cas = HEADER.unpack_from(
                    buf, offset
                )
            frame_end = offset + HEADER_SIZE + bodylen
            if magic != _REQUEST or frame_end > end:
                break
            if opaque != last_opaque:
                translator = streams.get(opaque)
                if translator is None:
                    break
                last_opaque = opaque
            assert translator is not None
            if opcode == DCP_MUTATION:
                if extlen != 31 or not keylen:
                    break
                key_at = offset + _DCP_MUTATION_END
                value_end = frame_end - nmeta
                if value_end < key_at + keylen or by_seqno <= translator.last_seqno:
                    break
                seqno = next_seqno
                next_seqno = seqno + 1 if seqno + 1 < _SEQNO_LIMIT else 1
                tap_flags = translator.item_flags & _NOT_ACK
                if ack_interval:
                    since += 1
                    if since >= ack_interval:
                        tap_flags |= _ACK
                        since = 0
                if not translator.network_byte_order:
                    if flags != last_flags:
                        last_flags = flags
                        swapped_flags = swapped.get(flags)
                        last_swapped = _swap(flags) if swapped_flags is None else swapped_flags
                    flags = last_swapped
                if translator.keys_only:
                    value_end = key_at + keylen
                head = _MUTATION.pack(
                    _REQUEST, _OP_MUTATION, keylen, 16, 0, translator.vbucket,
                    _MUTATION_FIXED + value_end - key_at, seqno, cas,
                    9, tap_flags, DEFAULT_TTL,
                    flags,
                    expiration, rev_seqno, nru,
                )  # fmt: skip
                mutations += 1
            elif opcode in _REMOVALS:
                if extlen != _DCP_REMOVAL_EXTRAS or not keylen:
                    break
                by_seqno, rev_seqno, nmeta = _DCP_REMOVAL.unpack_from(buf, offset + HEADER_SIZE)
                key_at = offset + HEADER_SIZE + _DCP_REMOVAL_EXTRAS
                value_end = key_at + keylen
                if frame_end - nmeta < value_end or by_seqno <= translator.last_seqno:
                    break
                seqno = next_seqno
                next_seqno = seqno + 1 if seqno + 1 < _SEQNO_LIMIT else 1
                tap_flags = 0
                if ack_interval:
                    since += 1
                    if since >= ack_interval:
                        tap_flags = _ACK
                        since = 0
                head = _DELETE.pack(
                    _REQUEST, _OP_DELETE, keylen, 8, 0, translator.vbucket,
                    _DELETE_FIXED + keylen, seqno, cas,
                    8, tap_flags, DEFAULT_TTL, rev_seqno,
                )  # fmt: skip
                deletions += 1
            elif opcode == _DCP_SNAPSHOT_MARKER and markers_too:
                if extlen != 20 or bodylen != 20 or keylen:
                    break
                start, snap_end, flags = _DCP_MARKER.unpack_from(buf, offset + HEADER_SIZE)
                if flags & _INLINE_MARKER_NOT:
                    break
                checkpoint_id = translator.open_checkpoint(start, snap_end, flags)
                if checkpoint_id is None:
                    break
                if checkpoint_id:  # (``NO_CHECKPOINT``: the snapshot opens unsaid)
                    seqno = next_seqno
                    next_seqno = seqno + 1 if seqno + 1 < _SEQNO_LIMIT else 1
                    since = 0
                    append(
                        _START.pack(
                            _REQUEST, _OP_CHECKPOINT_START, _START_KEYLEN, 16, 0,
                            translator.vbucket, _START_BODYLEN, seqno, 0, 0, control_flags,
                            DEFAULT_TTL, 0, 0, _START_KEY, checkpoint_id,
                        )
                    )  # fmt: skip
                    markers += 1
                    room -= 1
                credit += frame_end - offset
                offset = frame_end
                touched[translator.vbucket] = translator
                continue
            else:
                break
            append(head + view[key_at:value_end])
            room -= 1
            credit += frame_end - offset
            offset = frame_end
            # ``UprToTap.advance``, inline
            snapshot = translator.open
            if snapshot is not None and not translator.first_in_open:
                translator.first_in_open = by_seqno
            translator.last_seqno = by_seqno
            translator.items_in_snap += 1
            if translator is not last_touched:
                touched[translator.vbucket] = last_touched = translator
            if snapshot is not None and by_seqno >= snapshot.end:
                if snapshot.checkpoint_id == NO_CHECKPOINT:
                    translator.close_open()  # nothing to send: no room needed
                    continue
                if closed is None or room <= 0:
                    closing = translator
                    break
                # ``close_frame``, inline
                translator.close_open()
                checkpoint_id = snapshot.checkpoint_id
                seqno = next_seqno
                next_seqno = seqno + 1 if seqno + 1 < _SEQNO_LIMIT else 1
                since = 0
                if checkpoint_id is None:
                    append(
                        _OPAQUE.pack(
                            _REQUEST, _OP_OPAQUE, 0, 8, 0, translator.vbucket, 12, seqno, 0,
                            4, control_flags, DEFAULT_TTL, _CLOSE_BACKFILL,
                        )
                    )  # fmt: skip
                else:
                    append(
                        _END.pack(
                            _REQUEST, _OP_CHECKPOINT_END, _END_KEYLEN, 16, 0, translator.vbucket,
                            _END_BODYLEN, seqno, 0, 0, control_flags, DEFAULT_TTL, 0, 0, _END_KEY,
                            checkpoint_id,
                        )
                    )  # fmt: skip
                    closed += (translator.vbucket, checkpoint_id, by_seqno)
                    markers += 1
                room -= 1
    producer.end_run(next_seqno, since, len(out) - first_out)
    producer.keep_frames(out, first_out)
    return offset, credit, mutations, deletions, markers, closing


_SWAPPED: dict[int, int] = {}
"""Item flags in the other byte order, for the few values a bucket's items carry."""


def _swap(flags: int) -> int:
    swapped = swap32(flags)
    if len(_SWAPPED) < 1024:
        _SWAPPED[flags] = swapped
    return swapped


def snapshot_marker(buf: bytes | bytearray, offset: int) -> tuple[int, int, int, int] | None:
    """(stream opaque, start, end, flags) of a released-dialect SNAPSHOT_MARKER request
    at ``offset`` (whole in ``buf``), or None for any other frame."""
    if len(buf) - offset < HEADER_SIZE + 20:
        return None
    magic, opcode, keylen, extlen, _, _, bodylen, opaque, _ = HEADER.unpack_from(buf, offset)
    if magic != _REQUEST or opcode != _DCP_SNAPSHOT_MARKER or extlen != 20 or bodylen != 20:
        return None
    if keylen:
        return None
    start, end, flags = _DCP_MARKER.unpack_from(buf, offset + HEADER_SIZE)
    return opaque, start, end, flags


_CHECKPOINT = {
    opcode.value: struct.Struct(f">BBHBBHIIQHHB3xII{len(key)}sQ")
    for opcode, key in CHECKPOINT_KEYS.items()
}
_CHECKPOINT_KEYS = {opcode.value: key for opcode, key in CHECKPOINT_KEYS.items()}
_OP_CHECKPOINT_START = TapOpcode.CHECKPOINT_START.value
_OP_CHECKPOINT_END = TapOpcode.CHECKPOINT_END.value
# ``_checkpoint_frame``'s two layouts, spelled out for ``translate_items``
_START = _CHECKPOINT[_OP_CHECKPOINT_START]
_START_KEY = _CHECKPOINT_KEYS[_OP_CHECKPOINT_START]
_START_KEYLEN = len(_START_KEY)
_START_BODYLEN = 16 + _START_KEYLEN + 8
_END = _CHECKPOINT[_OP_CHECKPOINT_END]
_END_KEY = _CHECKPOINT_KEYS[_OP_CHECKPOINT_END]
_END_KEYLEN = len(_END_KEY)
_END_BODYLEN = 16 + _END_KEYLEN + 8
_OPAQUE = struct.Struct(">BBHBBHIIQHHB3xI")
_OP_OPAQUE = TapOpcode.OPAQUE.value
_CLOSE_BACKFILL = OpaqueCode.CLOSE_BACKFILL.value


def checkpoint_frame(producer: TapProducer, opcode: int, vbucket: int, checkpoint_id: int) -> bytes:
    """A stamped CHECKPOINT_START or CHECKPOINT_END (server layout, as ``UprToTap``
    makes them and the codec encodes them), kept by the producer."""
    data = _checkpoint_frame(producer.next_stamp, opcode, vbucket, checkpoint_id)
    producer.keep(data)
    return data


def _checkpoint_frame(
    next_stamp: Callable[..., tuple[int, int]], opcode: int, vbucket: int, checkpoint_id: int
) -> bytes:
    """The frame of ``checkpoint_frame``, stamped by ``next_stamp`` and not kept yet."""
    key = _CHECKPOINT_KEYS[opcode]
    seqno, tap_flags = next_stamp(0, force_ack=True)
    return _CHECKPOINT[opcode].pack(
        _REQUEST, opcode, len(key), 16, 0, vbucket, 16 + len(key) + 8, seqno, 0,
        0, tap_flags, DEFAULT_TTL, 0, 0, key, checkpoint_id,
    )  # fmt: skip


def close_frame(translator: UprToTap, producer: TapProducer) -> tuple[bytes, int | None] | None:
    """The fast path's ``close``: the stamped frame that closes the open snapshot (a
    CHECKPOINT_END, or OPAQUE(CLOSE_BACKFILL) for a backfill) and the checkpoint's
    id (None for a backfill), or None when nothing was open or the snapshot closes
    unsaid (``NO_CHECKPOINT``)."""
    snapshot = translator.close_open()
    if snapshot is None or snapshot.checkpoint_id == NO_CHECKPOINT:
        return None
    if snapshot.checkpoint_id is None:
        seqno, tap_flags = producer.next_stamp(0, force_ack=True)
        data = _OPAQUE.pack(
            _REQUEST, _OP_OPAQUE, 0, 8, 0, translator.vbucket, 12, seqno, 0,
            4, tap_flags, DEFAULT_TTL, _CLOSE_BACKFILL,
        )  # fmt: skip
        producer.keep(data)
        return data, None
    checkpoint_id = snapshot.checkpoint_id
    return (
        checkpoint_frame(producer, _OP_CHECKPOINT_END, translator.vbucket, checkpoint_id),
        checkpoint_id,
    )


def marker_frame(
    translator: UprToTap, producer: TapProducer, start: int, end: int, flags: int
) -> bytes | None:
    """The fast path's ``feed`` of a snapshot marker that opens a checkpoint with
    nothing open before it: the stamped CHECKPOINT_START (empty when the
    snapshot opens unsaid, ``NO_CHECKPOINT``); None (nothing done) for a marker
    the event path must take."""
    checkpoint_id = translator.open_checkpoint(start, end, flags)
    if checkpoint_id is None:
        return None
    if checkpoint_id == NO_CHECKPOINT:
        return b""
    return checkpoint_frame(producer, _OP_CHECKPOINT_START, translator.vbucket, checkpoint_id)
