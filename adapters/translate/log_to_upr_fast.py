"""The UPR front's serving fast path: a batch of log items to UPR frame bytes in one pass.

The event path (``cut_snapshots``, then per snapshot a ``SnapshotMarker``
event and per item ``ItemEncoder.encode``) builds a snapshot object, a
message per item and a list of messages the connection joins. For a
released-dialect stream whose markers carry no ACK (everything but a
takeover's send phase) ``BatchEncoder.encode`` cuts the same snapshots while
it packs: one precompiled struct per message kind (header and extras in one
pack), key and value appended as they are, one join per batch, and the
counts a stream keeps (markers, deletions, expirations) summed on the way.
It produces exactly the bytes of the event path; the property tests hold it
to that. An item the structs cannot take (a number too large for its field,
an empty key, a layout the dialect lacks) goes through ``ItemEncoder``,
which raises the codec's own error.

``BatchCut`` does the same for a disk read: it is fed the log's records as
the read walks them (``gateway.fronts.upr.segments.walk_records``), and
frames a block's items straight from the block's bytes (one struct unpack
and one pack per item, the key and value copied as one slice), with no
``LogItem`` per item. ``BatchCut.rows`` takes the same steps from ``LogItem``s:
the in-memory tail (``BatchEncoder.encode`` is a cut over all it is given)
and rows on disk (logs written before blocks, items a block cannot hold), so
the cut rule is written once for rows and once for block bytes.

``split`` finds where the flow-control window cuts such a batch: whole
messages while the window had room before each, as a producer stops only
once the buffer is full (the last one may overshoot), by walking the frame
headers of the part that goes, so nothing per message is kept for the
common case where the whole batch fits.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import HEADER
from adapters.translate.log_records import BLOCK_ITEM, ItemKind, LogItem
from adapters.translate.upr_snapshots import ItemEncoder
from adapters.upr.constants import Command, SnapshotFlags
from adapters.upr.dialect import Dialect, ItemLayout

_REQUEST = Magic.REQUEST.value
_DISK = SnapshotFlags.DISK.value
_MEMORY = SnapshotFlags.MEMORY.value
_CHECKPOINT = SnapshotFlags.CHECKPOINT.value
_MUTATION, _DELETION, _EXPIRATION = 0, 1, 2  # ItemKind values, as ints
_BODY_LENGTH = struct.Struct(">I")
_SEQNO = struct.Struct(">Q")
_HEAD = HEADER.format
_HEADER_SIZE = HEADER.size
_block_unpack = BLOCK_ITEM.unpack_from
_BLOCK_ITEM_SIZE = BLOCK_ITEM.size
_KINDS = tuple(ItemKind)
_NO_END = 2**64


class EncodedBatch(NamedTuple):
    data: bytes
    """Markers and items, in order, as one buffer."""
    markers: int
    deletions: int
    """Items logged as deletions (sent as DELETION)."""
    expirations: int
    """Items logged as expirations (sent as EXPIRATION or DELETION, per the consumer)."""
    items: int = 0
    last: int = 0
    """Seqno of the last item (0: none)."""
    arrival: float = 0.0
    """When the first item entered the log (the oldest: latency figures)."""


def _removal(
    opcode: int | None, layouts: tuple[ItemLayout, ...], delete_time: bool
) -> tuple[int, struct.Struct, int] | None:
    """(opcode, struct of header + extras, extras size) of a DELETION/EXPIRATION layout.

    The extras are by_seqno, rev_seqno, the delete time when asked for, and
    zero bytes for the rest (nmeta, pad), as the codec writes them.
    """
    layout = next((x for x in layouts if x.delete_time == delete_time), None)
    if opcode is None or layout is None:
        return None
    fields = "QQI" if delete_time else "QQ"
    pad = layout.size - struct.calcsize(">" + fields)
    return opcode, struct.Struct(f"{_HEAD}{fields}{pad}x"), layout.size


class BatchEncoder:
    """Frame bytes of log item batches for one stream (opaque, vbucket, consumer settings).

    Only for dialects with SNAPSHOT_MARKER (the draft's SNAPSHOT_START/END
    stay on the event path); ``ValueError`` otherwise.
    """

    __slots__ = ("_deletion", "_expiration", "_fallback", "_marker", "_marker_op",
                 "_mutation", "delete_times", "expiry_opcode", "opaque", "vbucket")  # fmt: skip

    def __init__(
        self,
        dialect: Dialect,
        opaque: int,
        vbucket: int,
        *,
        expiry_opcode: bool = False,
        delete_times: bool = False,
    ) -> None:
        opcodes = dialect.opcodes
        marker_op = opcodes.get(Command.SNAPSHOT_MARKER)
        if marker_op is None:
            raise ValueError(f"the {dialect.name} dialect has no SNAPSHOT_MARKER")
        self.opaque = opaque
        self.vbucket = vbucket
        self.delete_times = delete_times
        self.expiry_opcode = expiry_opcode
        self._marker_op = marker_op
        self._marker = struct.Struct(_HEAD + "QQI")
        mutation = dialect.mutation
        # by_seqno, rev_seqno, flags, expiration, lock time; nmeta and nru are zero.
        pad = mutation.size - struct.calcsize(">QQIII")
        self._mutation = (
            opcodes[Command.MUTATION],
            struct.Struct(f"{_HEAD}QQIII{pad}x"),
            mutation.size,
        )
        self._deletion = _removal(opcodes.get(Command.DELETION), dialect.deletion, delete_times)
        self._expiration = (
            _removal(opcodes.get(Command.EXPIRATION), dialect.expiration, delete_times)
            if expiry_opcode
            else self._deletion
        )
        self._fallback = ItemEncoder(
            dialect, opaque, vbucket, expiry_opcode=expiry_opcode, delete_times=delete_times
        )

    def mutation_layout(self) -> tuple[int, struct.Struct, int]:
        """(opcode, struct of header and extras, extras size) of this encoder's MUTATION."""
        return self._mutation

    def marker_struct(self) -> struct.Struct:
        return self._marker

    def marker_opcode(self) -> int:
        return self._marker_op

    def encode(self, items: Sequence[LogItem]) -> EncodedBatch:
        """Markers and items of ``items`` (seqno order), cut as ``cut_snapshots`` cuts them."""
        cut = BatchCut(self, -1, _NO_END, _NO_END, -1)
        cut.rows(items)
        return cut.finish()

    def split(self, data: bytes, start: int, room: int) -> tuple[int, int, int]:
        """(end offset, items, last item seqno) of what goes from ``start`` into ``room`` bytes.

        Whole messages while the bytes taken before each are under ``room``
        (at least one message); items are every message but markers.
        """
        marker_op = self._marker_op
        unpack_length, unpack_seqno = _BODY_LENGTH.unpack_from, _SEQNO.unpack_from
        offset, size = start, len(data)
        items = last = 0
        limit = start + room
        while offset < size and (offset < limit or offset == start):
            if data[offset + 1] != marker_op:
                items += 1
                last = unpack_seqno(data, offset + _HEADER_SIZE)[0]
            offset += _HEADER_SIZE + unpack_length(data, offset + 8)[0]
        return offset, items, last


class BatchCut:
    """One batch of a disk read, framed as ``BatchEncoder.encode`` frames the items it
    is fed: those with ``after < by_seqno <= upto``, until their keys and values
    reach ``left`` bytes (-1: no byte limit) or it holds ``limit`` items, then the
    rest of the block at hand (so the next read starts at a record, not
    inside a block walked again); ``finish`` gives the bytes.

    ``block`` and ``item`` take the records in log order and say when the batch is
    complete, as ``gateway.fronts.upr.segments.read_items`` reads them.
    """

    __slots__ = ("after", "arrival", "at", "backfill", "checkpoint", "deletions", "encoder",
                 "expirations", "items", "keys", "last", "left", "limit", "markers", "parts",
                 "snap_flags", "start", "upto", "whole")  # fmt: skip

    def __init__(self, encoder: BatchEncoder, after: int, upto: int, limit: int, left: int) -> None:
        self.encoder = encoder
        self.after = after
        self.upto = upto
        self.limit = limit
        self.left = left
        self.parts: list[bytes] = []
        self.at = -1
        """Index in parts of the open snapshot's marker (filled when it closes)."""
        self.start = 0
        self.last = 0
        self.snap_flags = 0
        self.backfill = 0
        self.checkpoint = 0
        self.keys: set[bytes] = set()
        self.markers = 0
        self.deletions = 0
        self.expirations = 0
        self.items = 0
        self.arrival = 0.0
        self.whole = True
        """Whether the last record fed was taken to its end (a later read may start
        after it)."""

    def block(self, payload: bytes) -> int:
        """The items of one block's payload (tag first): -1 if it does not parse, 1 once
        the batch is complete, else 0."""
        enc = self.encoder
        parts = self.parts
        append = parts.append
        vbucket, opaque = enc.vbucket, enc.opaque
        m_op, m_pack, m_ext = enc._mutation[0], enc._mutation[1].pack, enc._mutation[2]
        marker_pack, marker_op = enc._marker.pack, enc._marker_op
        removals = (None, enc._deletion, enc._expiration)
        delete_times = enc.delete_times
        after, upto, limit, left = self.after, self.upto, self.limit, self.left
        at, start, last, snap_flags = self.at, self.start, self.last, self.snap_flags
        run_backfill, run_checkpoint, keys = self.backfill, self.checkpoint, self.keys
        count, deletions, expirations, markers = (self.items, self.deletions, self.expirations,
                                                  self.markers)  # fmt: skip
        unpack, item_size = _block_unpack, _BLOCK_ITEM_SIZE
        pos, size = 1, len(payload)
        state = 0
        while pos < size:
            try:
                (seqno, kind, bits, dtype, klen, vlen, rev, cas, flags, exp, lock, cp, arr,
                 dt) = unpack(payload, pos)  # fmt: skip
            except struct.error:
                state = -1
                break
            k = pos + item_size
            v = k + klen
            pos = v + vlen
            if seqno <= after:
                continue
            if seqno > upto or pos > size:
                state = 1 if pos <= size else -1
                pos = -1  # not taken: the block is not read to its end
                break
            key = payload[k:v]
            bf = bits & 1
            if at < 0 or bf != run_backfill or cp != run_checkpoint or bits & 3 == 2 or key in keys:
                if at >= 0:
                    parts[at] = marker_pack(_REQUEST, marker_op, 0, 20, 0, vbucket, 20, opaque, 0,
                                            start, last, snap_flags)  # fmt: skip
                at = len(parts)
                append(b"")
                markers += 1
                start = seqno
                run_backfill, run_checkpoint = bf, cp
                snap_flags = _DISK if bf else (_MEMORY | _CHECKPOINT if bits & 2 else _MEMORY)
                keys = {key}
            else:
                keys.add(key)
            if not count:
                self.arrival = arr
            count += 1
            last = after = seqno
            try:
                if kind == _MUTATION:
                    if not klen:
                        raise struct.error("empty key")
                    append(m_pack(_REQUEST, m_op, klen, m_ext, dtype, vbucket,
                                  m_ext + klen + vlen, opaque, cas, seqno, rev, flags, exp,
                                  lock))  # fmt: skip
                    append(payload[k:pos])
                else:
                    if kind == _DELETION:
                        deletions += 1
                    else:
                        expirations += 1
                    removal = removals[kind]
                    if removal is None or not klen:
                        raise struct.error("no fast path")
                    op, pack, ext = removal[0], removal[1].pack, removal[2]
                    if delete_times:
                        append(pack(_REQUEST, op, klen, ext, 0, vbucket, ext + klen, opaque, cas,
                                    seqno, rev, dt))  # fmt: skip
                    else:
                        append(pack(_REQUEST, op, klen, ext, 0, vbucket, ext + klen, opaque, cas,
                                    seqno, rev))  # fmt: skip
                    append(key)
            except struct.error:  # the codec's error if it cannot be sent
                append(enc._fallback.encode(LogItem(seqno, _KINDS[kind], key, payload[v:pos], rev,
                                                    cas, flags, exp, lock, dtype, cp, bf == 1,
                                                    bits & 2 == 2, arr, dt)))  # fmt: skip
            if left >= 0:
                left -= klen + vlen
                if left <= 0:
                    state = 1
                    break
            if count >= limit and pos == size:
                state = 1
                break
        self.whole = pos == size
        self.after, self.left = after, left
        self.at, self.start, self.last, self.snap_flags = at, start, last, snap_flags
        self.backfill, self.checkpoint, self.keys = run_backfill, run_checkpoint, keys
        self.items, self.deletions, self.expirations, self.markers = (count, deletions, expirations,
                                                                      markers)  # fmt: skip
        return state if state or pos == size else -1

    def adopt(self, framed: tuple[bytes, int, int, int, float, int]) -> bool:
        """Take a write framed beforehand for this encoder (``log_preframing``) as the
        whole batch, when nothing is cut yet and this cut would take all of it (its
        items within ``limit``, its keys and values within ``left``, its last item
        within ``upto``): the bytes a walk of its records would frame. Whether taken."""
        data, markers, items, last, arrival, kv = framed
        if self.items or self.at >= 0 or items > self.limit or last > self.upto:
            return False
        if self.left >= 0:
            if kv > self.left:
                return False
            self.left -= kv
        self.parts.append(data)
        self.markers, self.items, self.last, self.after = markers, items, last, last
        self.arrival = arrival
        self.whole = True
        return True

    def item(self, item: LogItem) -> bool:
        """One item of a row; True once the batch is complete (the item may not be in it)."""
        return self.rows((item,))

    def rows(self, items: Sequence[LogItem]) -> bool:
        """Items as ``LogItem``s, in seqno order (the in-memory tail, rows on disk): the
        steps of ``block`` on their fields. True once the batch is complete (the
        item at hand may not be in it)."""
        enc = self.encoder
        parts = self.parts
        append = parts.append
        vbucket, opaque = enc.vbucket, enc.opaque
        m_op, m_pack, m_ext = enc._mutation[0], enc._mutation[1].pack, enc._mutation[2]
        marker_pack, marker_op = enc._marker.pack, enc._marker_op
        removals = (None, enc._deletion, enc._expiration)
        delete_times = enc.delete_times
        fallback = enc._fallback.encode
        after, upto, limit, left = self.after, self.upto, self.limit, self.left
        at, start, last, snap_flags = self.at, self.start, self.last, self.snap_flags
        run_backfill, run_checkpoint, keys = self.backfill, self.checkpoint, self.keys
        count, deletions, expirations, markers = (self.items, self.deletions, self.expirations,
                                                  self.markers)  # fmt: skip
        done = False
        whole = True
        for item in items:
            (seqno, kind, key, value, rev, cas, flags, exp, lock, dtype, cp, bf, cs, arr,
             dt) = item  # fmt: skip
            if seqno <= after:
                continue
            if seqno > upto:
                done, whole = True, False
                break
            # bf: a bool here, an int in ``block``; == holds where they mean the same.
            if (
                at < 0
                or bf != run_backfill
                or cp != run_checkpoint
                or (cs and not bf)
                or key in keys
            ):
                if at >= 0:
                    parts[at] = marker_pack(_REQUEST, marker_op, 0, 20, 0, vbucket, 20, opaque, 0,
                                            start, last, snap_flags)  # fmt: skip
                at = len(parts)
                append(b"")
                markers += 1
                start = seqno
                run_backfill, run_checkpoint = bf, cp
                snap_flags = _DISK if bf else (_MEMORY | _CHECKPOINT if cs else _MEMORY)
                keys = {key}
            else:
                keys.add(key)
            if not count:
                self.arrival = arr
            count += 1
            last = after = seqno
            klen = len(key)
            try:
                if kind == _MUTATION:
                    if not klen:
                        raise struct.error("empty key")
                    append(m_pack(_REQUEST, m_op, klen, m_ext, dtype, vbucket,
                                  m_ext + klen + len(value), opaque, cas, seqno, rev, flags, exp,
                                  lock))  # fmt: skip
                    append(key)
                    append(value)
                else:
                    if kind == _DELETION:
                        deletions += 1
                    else:
                        expirations += 1
                    removal = removals[kind]
                    if removal is None or not klen:
                        raise struct.error("no fast path")
                    op, pack, ext = removal[0], removal[1].pack, removal[2]
                    if delete_times:
                        append(pack(_REQUEST, op, klen, ext, 0, vbucket, ext + klen, opaque, cas,
                                    seqno, rev, dt))  # fmt: skip
                    else:
                        append(pack(_REQUEST, op, klen, ext, 0, vbucket, ext + klen, opaque, cas,
                                    seqno, rev))  # fmt: skip
                    append(key)
            except struct.error:  # the codec's error if it cannot be sent
                append(fallback(item))
            if count >= limit:
                done = True
                break
            if left >= 0:
                left -= klen + len(value)
                if left <= 0:
                    done = True
                    break
        self.whole = whole
        self.after, self.left = after, left
        self.at, self.start, self.last, self.snap_flags = at, start, last, snap_flags
        self.backfill, self.checkpoint, self.keys = run_backfill, run_checkpoint, keys
        self.items, self.deletions, self.expirations, self.markers = (count, deletions, expirations,
                                                                      markers)  # fmt: skip
        return done

    def _close_snapshot(self) -> None:
        enc = self.encoder
        if self.at >= 0:
            self.parts[self.at] = enc._marker.pack(
                _REQUEST, enc._marker_op, 0, 20, 0, enc.vbucket, 20, enc.opaque, 0, self.start,
                self.last, self.snap_flags
            )  # fmt: skip

    def finish(self) -> EncodedBatch:
        """The batch's bytes (the last snapshot's marker filled in)."""
        self._close_snapshot()
        self.at = -1
        return EncodedBatch(b"".join(self.parts), self.markers, self.deletions, self.expirations,
                            self.items, self.last, self.arrival)  # fmt: skip
