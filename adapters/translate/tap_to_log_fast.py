"""The UPR front's ingest fast path: TAP item frames straight to log records.

``FrameReader``, ``decode_frame`` and ``TapToUpr.feed`` build a frame, a frozen
event with an ``IntFlag`` field and a list per item. For the dominant
messages (MUTATION and DELETE with the 2.x engine-specific rev_seqno,
CHECKPOINT_START/END in the server layout) ``log_buffer`` walks the frames
of one socket read in place (one unpack of header and extras per mutation)
and packs each item's record straight into its vbucket's write buffer
(``PackBuffer``: the block layout of ``log_records.BLOCK_ITEM``, the key and
value copied from the read in one slice), with no ``LogItem`` in between. A
mutation is ``TapToUpr.mutation`` inline (the frame always carries a
rev_seqno), with the translator's and the buffer's state read once per run
of one vbucket's items; a delete and the checkpoints call the translator's
own methods (``.delete``, ``.checkpoint_start``/``_end``). A property test
holds both paths to the same records, bytes, blocks and sparse index. It
stops at anything else (other layouts, frames the decoder would refuse,
control messages), which keeps the event path, which names what is wrong.

``ack_frame`` is the TAP ack ``encode(TapResponse(opcode, opaque, 0))``
makes, packed in one struct.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Protocol, TypeVar

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import DEFAULT_MAX_FRAME_SIZE, HEADER
from adapters.tap.constants import TapFlags, TapOpcode
from adapters.translate.log_preframing import Framing
from adapters.translate.log_records import BLOCK_ITEM, ItemKind, MarkKind
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
_HEADER_TAP = struct.Struct(HEADER.format + "HH")
"""A header, then the engine-specific length and TAP flags (a checkpoint's extras)."""
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
_ITEM_MUTATION = ItemKind.MUTATION.value
_MARK_START = MarkKind.CHECKPOINT_START.value
_MARK_END = MarkKind.CHECKPOINT_END.value
_tuple_new = tuple.__new__


class PackBuffer(Protocol):
    """Where ``log_buffer`` packs a vbucket's items (``gateway.fronts.upr.write_buffer``):
    its bytes, the block of items open at their end, the sparse index's entries."""

    data: bytearray
    block: int
    """Offset in ``data`` of the block open at its end (-1: none)."""
    block_bytes: int
    """A block is closed once it holds more than this many bytes."""
    sparse: list[tuple[int, int]]
    due: int
    """Items to pack before the next one ``sparse`` names (0: the next)."""
    sparse_every: int
    framing: Framing | None
    """The buffered items' UPR messages for the stream that follows (``log_preframing``)."""

    def new_block(self) -> int:
        """Close the open block, open one at the end of ``data``; its offset."""
        ...

    def added(self, count: int, first: int, high: int) -> None:
        """``count`` items, seqnos ``first`` to ``high``, were packed into ``data``."""
        ...

    def add_mark_fields(self, kind: int, value: int) -> None:
        """Close the open block, append the mark ``LogMark(kind, value)``."""
        ...


class ItemSink(Protocol):
    """What ``log_buffer`` feeds: a vbucket's translator and its write buffer."""

    @property
    def translator(self) -> TapToUpr: ...

    @property
    def buffer(self) -> PackBuffer: ...


S = TypeVar("S", bound=ItemSink)
_ACK = TapFlags.ACK.value
_item_pack = BLOCK_ITEM.pack


def log_buffer(
    data: bytes,
    start: int,
    sinks: Mapping[int, S],
    now: float,
    touched: dict[int, S],
    acks: list[bytes],
    max_frames: int = -1,
) -> tuple[int, int]:
    """Log the run of MUTATION/DELETE frames (each unpacked once, in place, and packed
    straight into its vbucket's write buffer) and CHECKPOINT_START/END frames of the
    server layout that ``data`` holds from offset ``start``, at most ``max_frames`` of
    them (-1: no limit).

    Returns (offset, frames): where it stopped, and how many frames it took.
    It stops at a frame cut short by the end of ``data`` and at one it leaves
    for the event path (another message, a new vbucket, anything
    ``FrameReader`` or the decoder would refuse: that path names what is wrong).

    Each item goes to its vbucket's buffer, the sink into ``touched``, and the
    ack a frame asks for onto ``acks``, in order.
    """
    run = _Run()
    try:
        return _log(data, start, sinks, now, touched, acks, max_frames, run)
    finally:
        run.end()


class _Run:
    """The items ``_log`` packed into one vbucket's buffer since it last reported them."""

    __slots__ = ("buffer", "count", "due", "first", "high")

    def __init__(self) -> None:
        self.buffer: PackBuffer | None = None
        self.count = 0
        self.due = 0
        self.first = 0
        self.high = 0

    def end(self) -> None:
        buffer = self.buffer
        if buffer is not None:
            buffer.due = self.due
            if self.count:
                buffer.added(self.count, self.first, self.high)
            self.buffer = None
            self.count = 0


def _log(
    data: bytes,
    start: int,
    sinks: Mapping[int, S],
    now: float,
    touched: dict[int, S],
    acks: list[bytes],
    max_frames: int,
    run: _Run,
) -> tuple[int, int]:
    """``log_buffer``'s loop. The vbucket of the last item keeps its translator state
    and its buffer's in locals (``cached``); ``run`` holds what is to be reported to
    that buffer (``_Run.end``: before anything else touches it, and at the end)."""
    header, mutation, delete = _HEADER.unpack_from, _MUTATION.unpack_from, _DELETE.unpack_from
    head_item = _HEADER_MUTATION.unpack_from
    head_tap = _HEADER_TAP.unpack_from
    tap_fields, checkpoint_id = _TAP_FLAGS.unpack_from, _ID.unpack_from
    host_flags = _HOST_FLAGS.unpack_from
    ack = _RESPONSE_HEADER.pack
    pack = _item_pack
    size = len(data)
    offset = start
    taken = 0
    # The vbucket whose state the locals below hold (-1: none).
    cached = -1
    translator: TapToUpr
    index: dict[bytes, Version] = {}
    index_get = index.get
    resetting: set[bytes] | None = None
    backfill = first_pending = False
    bits = checkpoint = 0
    buf = bytearray()
    block = limit = due = every = 0
    no_sparse: list[tuple[int, int]] = []
    sparse_append = no_sparse.append
    count = run_first = seqno = 0
    # The cached vbucket's framing for the stream that follows it (None: not framed).
    framing: Framing | None = None
    f_parts: list[bytes] = []
    f_append = f_parts.append
    f_pack = _item_pack
    f_op = f_ext = f_vb = f_opaque = 0
    f_start = -1
    try:
        while offset + 24 <= size and taken != max_frames:
            op = data[offset + 1]
            if op == OP_MUTATION and offset + 48 <= size:
                # The common case: header, extras and rev_seqno in one unpack (checked below).
                (magic, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas,
                 es_len, tap_flags, ttl, flags, expiration, rev_seqno,
                 ) = head_item(data, offset)  # fmt: skip
            elif op in (OP_CHECKPOINT_START, OP_CHECKPOINT_END) and offset + 28 <= size:
                # One per live item each: header and TAP flags in one unpack (checked below).
                (magic, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas, es_len,
                 tap_flags) = head_tap(data, offset)  # fmt: skip
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
                    es_len, tap_flags, ttl, flags, expiration, rev_seqno = mutation(data, body)
                if (es_len != 8 and es_len != 9) or not ttl:  # TTL 0: the event path refuses it
                    break
                key_start = body + 16 + es_len
                key_end = key_start + keylen
                if key_end > end:
                    break
                if flags and not tap_flags & _NETWORK_BYTE_ORDER:  # 0 reads the same either way
                    flags = host_flags(data, body + 8)[0]
            elif opcode == OP_DELETE:
                if bodylen < 16:
                    break
                es_len, tap_flags, ttl, rev_seqno = delete(data, body)
                if es_len != 8 or 16 + keylen > bodylen or not ttl:
                    break
                key_start = body + 16
                key_end = key_start + keylen
            elif opcode in (OP_CHECKPOINT_START, OP_CHECKPOINT_END):
                # The server layout (a key, the id as an 8-byte value): one per live item
                # of a 2.x stream that keeps up, so not worth an event each.
                if bodylen < 16:
                    break
                if es_len < 0:
                    es_len, tap_flags = tap_fields(data, body)
                key_end = body + 16 + es_len + keylen
                if key_end > end or end - key_end != 8 or not data[body + 4]:  # TTL 0
                    break
                if cached >= 0:
                    run.count, run.due, run.first, run.high = count, due, run_first, seqno
                    run.end()
                    cached = -1
                mark_id = checkpoint_id(data, key_end)[0]
                if opcode == OP_CHECKPOINT_START:
                    sink.translator.open_checkpoint(mark_id)
                    sink.buffer.add_mark_fields(_MARK_START, mark_id)
                else:
                    sink.translator.close_checkpoint(mark_id)
                    sink.buffer.add_mark_fields(_MARK_END, mark_id)
                touched[vbucket] = sink
                if tap_flags & _ACK:
                    acks.append(ack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0))
                offset = end
                taken += 1
                continue
            else:
                break
            if vbucket != cached:
                if cached >= 0:
                    run.count, run.due, run.first, run.high = count, due, run_first, seqno
                    run.end()
                # This vbucket's translator and buffer state, read once per run of its items.
                translator = sink.translator
                index = translator.index
                index_get = index.get
                resetting = translator.resetting
                backfill = translator.in_backfill
                checkpoint = 0 if backfill else translator.checkpoint_id or 0
                first_pending = translator._checkpoint_start
                bits = 1 if backfill else 2 if first_pending else 0
                buffer = sink.buffer
                buf = buffer.data
                block = buffer.block
                limit = block + buffer.block_bytes if block >= 0 else -1
                due = buffer.due
                every = buffer.sparse_every
                sparse_append = buffer.sparse.append
                framing = buffer.framing
                if framing is not None:
                    f_append, f_pack, f_op, f_ext = (framing.parts.append, framing.pack,
                                                     framing.op, framing.ext)  # fmt: skip
                    f_vb, f_opaque = framing.vbucket, framing.opaque
                    # A mark before this run may have changed what its items are.
                    f_start = framing.start if framing.fits(bits, checkpoint) else -1
                count = 0
                touched[vbucket] = sink
                run.buffer, cached = buffer, vbucket  # together: ``finally`` reports to it
            key = data[key_start:key_end]
            if opcode == OP_MUTATION:
                # ``TapToUpr.mutation`` inline (the frame always carries rev_seqno).
                if resetting is not None:
                    resetting.add(key)
                old = index_get(key)
                if old is not None and old[2] == rev_seqno and old[1] == cas and not old[4]:
                    translator.duplicates += 1
                else:
                    translator.high_seqno = seqno = translator.high_seqno + 1
                    index[key] = (seqno, cas, rev_seqno, expiration, False)
                    if len(buf) > limit:
                        block = buffer.new_block()
                        limit = block + buffer.block_bytes
                    if due:
                        due -= 1
                    else:
                        sparse_append((seqno, block))
                        due = every - 1
                    buf += pack(seqno, _ITEM_MUTATION, bits, datatype, keylen,
                                end - key_end, rev_seqno, cas, flags, expiration, 0,
                                checkpoint, now, 0)  # fmt: skip
                    kv = data[key_start:end]
                    buf += kv  # the key and the value, as a block holds them
                    if framing is not None:
                        # ``BatchCut``'s cut: a key the snapshot holds, a checkpoint's first.
                        if f_start < 0 or bits == 2 or (old is not None and old[0] >= f_start):
                            f_start = framing.open(seqno, bits, checkpoint, now)
                        f_append(f_pack(_REQUEST, f_op, keylen, f_ext, datatype, f_vb,
                                        f_ext + end - key_start, f_opaque, cas, seqno, rev_seqno,
                                        flags, expiration, 0))  # fmt: skip
                        f_append(kv)
                    if not count:
                        run_first = seqno
                    count += 1
                    if first_pending:
                        translator._checkpoint_start = first_pending = False
                        bits = 1 if backfill else 0
            else:
                if framing is not None:
                    framing = buffer.framing = None  # a delete ends the write's framing
                item = translator.delete(key, cas, rev_seqno, now)
                if first_pending and not translator._checkpoint_start:
                    first_pending = False
                    bits = 1 if backfill else 0
                if item is not None:
                    seqno = item.by_seqno
                    if len(buf) > limit:
                        block = buffer.new_block()
                        limit = block + buffer.block_bytes
                    if due:
                        due -= 1
                    else:
                        sparse_append((seqno, block))
                        due = every - 1
                    (seqno, kind, key, _, rev, cas, _, _, _, _, cp, bf, cs, _, dt) = item
                    buf += pack(seqno, kind, bf | cs << 1, 0, keylen, 0, rev, cas, 0, 0, 0, cp,
                                now, dt)  # fmt: skip
                    buf += key
                    if not count:
                        run_first = seqno
                    count += 1
            if tap_flags & _ACK:
                acks.append(ack(_RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, 0))
            offset = end
            taken += 1
    finally:
        if cached >= 0:  # what ``run.end`` reports, whatever stopped the loop
            run.count, run.due, run.first, run.high = count, due, run_first, seqno
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
