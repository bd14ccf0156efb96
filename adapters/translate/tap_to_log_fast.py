"""The UPR front's ingest fast path: TAP item frames straight to log records.

``FrameReader``, ``decode_frame`` and ``TapToUpr.feed`` build a frame, a frozen
event with an ``IntFlag`` field and a list per item. For the dominant
messages (MUTATION and DELETE with the 2.x engine-specific rev_seqno,
CHECKPOINT_START/END in the server layout) ``log_buffer`` walks the frames
of one socket read in place (one unpack of header and extras per mutation,
the key and value sliced out of the read) and hands the fields to the
same translator methods the event path ends in (``TapToUpr.mutation``,
``.delete``, ``.checkpoint_start``/``_end``), so both paths log the same
records (a property test holds them together). The commonest case, a
mutation of a key the vbucket's index lacks outside a reconcile, is
``TapToUpr.mutation`` inline, with the translator's state read once per run
of one vbucket's items. It stops at anything else
(other layouts, frames the decoder would refuse, control messages), which
keeps the event path, which names what is wrong.

``ack_frame`` is the TAP ack ``encode(TapResponse(opcode, opaque, 0))``
makes, packed in one struct.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import DEFAULT_MAX_FRAME_SIZE, HEADER
from adapters.tap.constants import TapFlags, TapOpcode
from adapters.translate.log_records import ItemKind, LogItem, LogMark
from adapters.translate.tap_to_upr import TapToUpr, Version

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
_HEADER = HEADER
_HEADER_MUTATION = struct.Struct(HEADER.format + _MUTATION.format[1:])
MAX_BODY = DEFAULT_MAX_FRAME_SIZE
"""The body length ``FrameReader`` takes by default; a frame declaring more is refused."""
_REQUEST = Magic.REQUEST.value
_RESPONSE = Magic.RESPONSE.value
OP_MUTATION = TapOpcode.MUTATION.value
OP_DELETE = TapOpcode.DELETE.value
OP_CHECKPOINT_START = TapOpcode.CHECKPOINT_START.value
OP_CHECKPOINT_END = TapOpcode.CHECKPOINT_END.value
_TAP_FLAGS = struct.Struct(">HH")
_ID = struct.Struct(">Q")
_ITEM_MUTATION = ItemKind.MUTATION
_tuple_new = tuple.__new__


class ItemSink(Protocol):
    """What ``log_frames`` feeds: a vbucket's translator and where its items go."""

    @property
    def translator(self) -> TapToUpr: ...

    def append_items(self, items: list[LogItem]) -> None: ...

    def append_mark(self, mark: LogMark) -> None: ...


S = TypeVar("S", bound=ItemSink)
_ACK = TapFlags.ACK.value


def log_buffer(
    data: bytes,
    start: int,
    sinks: Mapping[int, S],
    now: float,
    touched: dict[int, S],
    acks: list[bytes],
    max_frames: int = -1,
) -> tuple[int, int]:
    """Log the run of MUTATION/DELETE frames (each unpacked once, in place, straight
    to its log item) and CHECKPOINT_START/END frames of the server layout that
    ``data`` holds from offset ``start``, at most ``max_frames`` of them (-1: no limit).

    Returns (offset, frames): where it stopped, and how many frames it took.
    It stops at a frame cut short by the end of ``data`` and at one it leaves
    for the event path (another message, a new vbucket, anything
    ``FrameReader`` or the decoder would refuse: that path names what is wrong).

    Each item goes to its vbucket's sink (the items of a vbucket in one call
    per run between its marks), the sink into ``touched``, and the ack a
    frame asks for onto ``acks``, in order.
    """
    runs: dict[int, list[LogItem]] = {}
    try:
        return _log(data, start, sinks, now, touched, acks, max_frames, runs)
    finally:
        for vbucket, items in runs.items():
            if items:
                sinks[vbucket].append_items(items)


def _log(
    data: bytes,
    start: int,
    sinks: Mapping[int, S],
    now: float,
    touched: dict[int, S],
    acks: list[bytes],
    max_frames: int,
    runs: dict[int, list[LogItem]],
) -> tuple[int, int]:
    """``log_buffer``'s loop; each vbucket's items are left in ``runs`` (a mark hands
    its vbucket's run to the sink first)."""
    header, mutation, delete = _HEADER.unpack_from, _MUTATION.unpack_from, _DELETE.unpack_from
    head_item = _HEADER_MUTATION.unpack_from
    host_flags = _HOST_FLAGS.unpack_from
    ack = _RESPONSE_HEADER.pack
    size = len(data)
    offset = start
    taken = 0
    new = _tuple_new
    item: LogItem | None
    # The translator state of the vbucket of the last item inlined (-1: none cached).
    plain_vb = -1
    plain = backfill = False
    checkpoint = 0
    translator: TapToUpr  # set with plain_vb
    index: dict[bytes, Version] = {}
    index_get = index.get
    # The run of the vbucket of the last item (-1: none cached).
    run_vb = -1
    no_run: list[LogItem] = []
    run_append: Callable[[LogItem], None] = no_run.append
    while offset + 24 <= size and taken != max_frames:
        if data[offset + 1] == OP_MUTATION and offset + 48 <= size:
            # The common case: header, extras and rev_seqno in one unpack (checked below).
            (magic, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas, es_len,
             tap_flags, _, flags, expiration, rev_seqno) = head_item(data, offset)  # fmt: skip
        else:
            magic, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas = header(
                data, offset
            )
            es_len = -1
        body = offset + 24
        end = body + bodylen
        if (
            magic != _REQUEST
            or not keylen
            or end > size
            or bodylen > MAX_BODY
            or extlen + keylen > bodylen
        ):
            break
        sink = sinks.get(vbucket)
        if sink is None:
            break
        if opcode == OP_MUTATION:
            if bodylen < 24:
                break
            if es_len < 0:
                es_len, tap_flags, _, flags, expiration, rev_seqno = mutation(data, body)
            if es_len != 8 and es_len != 9:
                break
            key_start = body + 16 + es_len
            key_end = key_start + keylen
            if key_end > end:
                break
            if not tap_flags & _NETWORK_BYTE_ORDER:
                flags = host_flags(data, body + 8)[0]
            key = data[key_start:key_end]
            if vbucket != plain_vb:
                # This vbucket's translator state, read once per run of its items.
                translator = sink.translator
                index, index_get = translator.index, translator.index.get
                plain = translator.resetting is None and not translator._checkpoint_start
                backfill = translator.in_backfill
                checkpoint = 0 if backfill else translator.checkpoint_id or 0
                plain_vb = vbucket
            if plain and index_get(key) is None:
                # ``TapToUpr.mutation`` inline for a new key outside a reconcile and
                # after a checkpoint's first item (no resetting set, no duplicate,
                # no first-item bit): one Python call less per item.
                translator.high_seqno = seqno = translator.high_seqno + 1
                index[key] = (seqno, cas, rev_seqno, expiration, False)
                item = new(LogItem, (
                    seqno, _ITEM_MUTATION, key, data[key_end:end], rev_seqno, cas, flags,
                    expiration, 0, datatype, checkpoint, backfill, False, now, 0,
                ))  # fmt: skip
            else:
                item = sink.translator.mutation(
                    key, data[key_end:end], cas, flags, expiration, rev_seqno, datatype,
                    tap_flags | _NETWORK_BYTE_ORDER, now,
                )  # fmt: skip
                plain_vb = -1  # its state may have moved (first item of a checkpoint)
        elif opcode == OP_DELETE:
            if bodylen < 16:
                break
            es_len, tap_flags, _, rev_seqno = delete(data, body)
            if es_len != 8 or 16 + keylen > bodylen:
                break
            item = sink.translator.delete(data[body + 16 : body + 16 + keylen], cas, rev_seqno, now)
            plain_vb = -1
        elif opcode in (OP_CHECKPOINT_START, OP_CHECKPOINT_END):
            # The server layout (a key, the id as an 8-byte value): one per live item
            # of a 2.x stream that keeps up, so not worth an event each.
            if bodylen < 16:
                break
            es_len, tap_flags = _TAP_FLAGS.unpack_from(data, body)
            key_end = body + 16 + es_len + keylen
            if key_end > end or end - key_end != 8:
                break
            checkpoint = _ID.unpack_from(data, key_end)[0]
            translator = sink.translator
            run = runs.get(vbucket)
            if run:
                sink.append_items(run)
                runs[vbucket] = []
            run_vb = -1  # its run is a new list
            if opcode == OP_CHECKPOINT_START:
                sink.append_mark(translator.checkpoint_start(checkpoint))
            else:
                sink.append_mark(translator.checkpoint_end(checkpoint))
            item = None
            plain_vb = -1
        else:
            break
        if item is not None:
            if vbucket == run_vb:
                run_append(item)
            else:
                run = runs.get(vbucket)
                if run is None:
                    run = runs[vbucket] = [item]
                    touched[vbucket] = sink
                else:
                    run.append(item)
                run_vb, run_append = vbucket, run.append
        else:
            touched[vbucket] = sink
        if tap_flags & _ACK:
            acks.append(ack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0))
        offset = end
        taken += 1
    return offset, taken


def frame_end(data: bytes, offset: int, lenient_responses: bool = False) -> int | None:
    """End offset of the frame at ``offset`` if ``data`` holds it whole, None if not.

    A header ``FrameReader`` refuses on its own (bad magic, a body over the
    limit, extras and key longer than the body) ends with the header: the
    reader raises on it without waiting for the body.
    """
    if len(data) - offset < 24:
        return None
    magic, _, keylen, extlen, _, _, bodylen, _, _ = _HEADER.unpack_from(data, offset)
    if (
        (magic != _REQUEST and magic != _RESPONSE)
        or bodylen > MAX_BODY
        or (extlen + keylen > bodylen and not (magic == _RESPONSE and lenient_responses))
    ):
        return offset + 24
    end = offset + 24 + bodylen
    return end if end <= len(data) else None


def ack_frame(opcode: int, opaque: int) -> bytes:
    """The TAP ack of a request: a response with status 0 and no body."""
    return _RESPONSE_HEADER.pack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0)
