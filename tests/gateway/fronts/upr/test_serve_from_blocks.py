"""A disk read frames UPR messages straight from the log's bytes (``BatchCut``).

For any log (items in blocks, items as rows as logs were written before
blocks, both in one log, marks between), any read (from any seqno, up to any
seqno, count or size, as ``LogStream`` asks) and any chunking of the file
(records cut at any chunk end), the bytes ``BatchCut`` frames are exactly
what the event path sends for the items a read takes (those ``read_items``
reads, the item limit extended to the end of the block at hand): a
SNAPSHOT_MARKER per snapshot (``cut_snapshots``) and ``ItemEncoder``'s
message per item, with the expiry opcode and delete times on or off
(ep-engine v3.0.0 src/upr-producer.cc, src/upr-stream.cc).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.errors import LocalProtocolError
from adapters.translate.log_records import ItemKind, LogItem, LogMark, MarkKind, to_row
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from adapters.translate.upr_snapshots import ItemEncoder, cut_snapshots
from gateway.fronts.upr.segments import (
    buffer_items,
    close_block,
    feed_part,
    frame,
    frame_mark,
    scan_bytes,
)

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)

_fields = st.tuples(
    st.sampled_from(list(ItemKind)),
    st.sampled_from([b"a", b"b", b"key-c", b"d" * 30]),
    st.binary(max_size=40),
    st.booleans(),  # backfill
    st.integers(0, 3),  # checkpoint id
    st.booleans(),  # checkpoint start
    st.tuples(U64, U64, U32, U32, U32, st.integers(0, 255), st.floats(0, 2e9)),
    # One past the block's range now and then: that item goes as a row of its own.
    st.one_of(U32, U32, U32, st.just(2**32)),
)
_marks = st.builds(LogMark, st.sampled_from(list(MarkKind)), st.integers(0, 2**64 - 1))


def _build(generated: list, gaps: list[int], marks: list[tuple[int, LogMark]]) -> list:
    records: list[LogItem | LogMark] = []
    seqno = 0
    for (kind, key, value, backfill, cp, first, nums, dtime), gap in zip(
        generated, gaps, strict=False
    ):
        seqno += gap
        rev, cas, flags, exp, lock, dtype, arrival = nums
        records.append(LogItem(seqno, kind, key, value if kind is ItemKind.MUTATION else b"",
                               rev, cas, flags, exp, lock, dtype, 0 if backfill else cp, backfill,
                               first, arrival, dtime))  # fmt: skip
    for at, mark in sorted(marks, key=lambda pair: -pair[0]):
        records.insert(min(at, len(records)), mark)
    return records


def _log_bytes(records: list[LogItem | LogMark], rows_upto: int) -> bytes:
    """The first ``rows_upto`` records as rows (a log from before blocks), the rest as
    the ingest buffers them (runs of items in blocks, marks between)."""
    buffer = bytearray(b"".join(frame(to_row(r)) for r in records[:rows_upto]))
    block = -1
    sparse: list[tuple[int, int]] = []
    for record in records[rows_upto:]:
        if isinstance(record, LogItem):
            block = buffer_items(buffer, block, [record], 0, sparse)
        else:
            close_block(buffer, block)
            block = -1
            buffer += frame_mark(record)
    close_block(buffer, block)
    return bytes(buffer)


def _expected_read(
    items: list[LogItem], after: int, upto: int, limit: int, left: int, record: dict[int, int]
) -> list:
    """What a disk read takes of ``items`` (``record``: the offset of each one's
    record), one by one: up to ``limit`` items, then the rest of that record."""
    out: list[LogItem] = []
    for item in items:
        if item.by_seqno <= after:
            continue
        if item.by_seqno > upto:
            break
        if len(out) >= limit and record[item.by_seqno] != record[out[-1].by_seqno]:
            break
        out.append(item)
        after = item.by_seqno
        if left >= 0:
            left -= len(item.key) + len(item.value)
            if left <= 0:
                break
    return out


def _event_path(items: list[LogItem], encoder: ItemEncoder) -> bytes:
    """What ``LogStream._send_batch`` sends for ``items`` on the event path."""
    out = []
    for snap in cut_snapshots(items):
        marker = upr.SnapshotMarker(snap.start, snap.end, snap.flags, opaque=encoder.opaque,
                                    vbucket=encoder.vbucket)  # fmt: skip
        out.append(upr.encode(marker))
        out.extend(encoder.encode(item) for item in snap.items)
    return b"".join(out)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_fields, max_size=40),
    st.lists(st.integers(1, 3), min_size=40, max_size=40),
    st.lists(st.tuples(st.integers(0, 40), _marks), max_size=4),
    st.one_of(st.just(0), st.integers(0, 45)),
    st.data(),
    st.booleans(),
    st.booleans(),
)
def test_a_disk_read_frames_what_the_event_path_sends(
    generated: list,
    gaps: list[int],
    marks: list[tuple[int, LogMark]],
    rows_upto: int,
    data: st.DataObject,
    expiry: bool,
    times: bool,
) -> None:
    records = _build(generated, gaps, marks)
    items = [r for r in records if isinstance(r, LogItem)]
    log = _log_bytes(records, rows_upto)
    high = items[-1].by_seqno if items else 0
    after = data.draw(st.integers(0, high + 1), "after")
    upto = data.draw(st.integers(after, high + 2), "upto")
    limit = data.draw(st.integers(1, 45), "limit")
    left = data.draw(st.integers(-1, 2000), "left")
    chunk = data.draw(st.integers(1, max(1, len(log))), "chunk")
    opaque, vbucket = data.draw(U32, "opaque"), data.draw(st.integers(0, 0xFFFF), "vbucket")
    record = {row[1]: offset for offset, _end, row in scan_bytes(log) if row[0] == 0}
    expected = _expected_read(items, after, upto, limit, left, record)
    cut = BatchCut(BatchEncoder(upr.DCP, opaque, vbucket, expiry_opcode=expiry,
                                delete_times=times), after, upto, limit, left)  # fmt: skip

    def read(_fd: int, offset: int, size: int) -> bytes:
        return log[offset : offset + size]

    try:
        want = _event_path(expected, ItemEncoder(upr.DCP, opaque, vbucket, expiry_opcode=expiry,
                                                 delete_times=times))  # fmt: skip
    except LocalProtocolError as exc:  # a delete time past 32 bits, asked for
        with pytest.raises(LocalProtocolError, match=re.escape(str(exc))):
            feed_part(0, 0, len(log), cut, chunk, read)
        return
    feed_part(0, 0, len(log), cut, chunk, read)
    encoded = cut.finish()
    assert encoded.data == want
    assert encoded.items == len(expected)
    assert encoded.markers == len(cut_snapshots(expected))
    kinds = [item.kind for item in expected]
    assert encoded.deletions == kinds.count(ItemKind.DELETION)
    assert encoded.expirations == kinds.count(ItemKind.EXPIRATION)
    assert encoded.last == (expected[-1].by_seqno if expected else 0)
    assert encoded.arrival == (expected[0].arrival if expected else 0.0)
