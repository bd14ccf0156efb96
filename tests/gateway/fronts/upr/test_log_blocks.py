"""Blocks of items in the UPR front's log segments (``segments.buffer_items``).

For any run of items and marks buffered as the ingest buffers them (items in
blocks, one at a time or in runs, a mark closing the open block, an item
whose fields the block cannot hold going as a row of its own),
``scan_bytes`` gives every record's row in order, each item's at the offset
``buffer_items`` named for the sparse index,
``read_items`` gives the items themselves (from any seqno, up to any seqno,
count or size, as ``VbLog.read`` asks), and a log written with a row per
item (before blocks) reads the same. A block is one record: cut short it is
a torn tail, a flipped bit anywhere in it is damage.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.translate.log_records import ItemKind, LogItem, LogMark, MarkKind, to_row
from gateway.fronts.upr.segments import (
    BLOCK_BYTES,
    SPARSE_EVERY,
    buffer_items,
    close_block,
    frame,
    frame_mark,
    read_items,
    scan_bytes,
    tail_fault,
)

_items = st.builds(
    LogItem,
    st.integers(1, 2**64 - 1),
    st.sampled_from(list(ItemKind)),
    st.binary(min_size=1, max_size=250),
    st.one_of(st.binary(max_size=300), st.just(b"v" * (BLOCK_BYTES // 3))),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    # One past a field's range now and then: that item goes as a row.
    st.integers(0, 2**32),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 255),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.booleans(),
    st.floats(0, 2e9),
    st.integers(0, 2**32 - 1),
)
_marks = st.builds(LogMark, st.sampled_from(list(MarkKind)), st.integers(0, 2**64 - 1))
_records = st.lists(st.one_of(_items, _items, _marks), min_size=1, max_size=20)


def _buffer(records: list[LogItem | LogMark], first: int = -1) -> tuple[bytes, list[int]]:
    """The bytes the ingest buffers for ``records``, and the sparse offsets: of each
    item (``first`` -1: one item at a time), else of every SPARSE_EVERY-th item of
    each run between marks from ``first`` on (a run at a time)."""
    buffer = bytearray()
    block = -1
    sparse: list[tuple[int, int]] = []
    run: list[LogItem] = []
    for record in [*records, None]:
        if isinstance(record, LogItem):
            if first < 0:
                block = buffer_items(buffer, block, [record], 0, sparse)
            else:
                run.append(record)
            continue
        if run:
            block = buffer_items(buffer, block, run, first, sparse)
            run = []
        close_block(buffer, block)
        block = -1
        if record is not None:
            buffer += frame_mark(record)
    return bytes(buffer), [offset for _, offset in sparse]


@settings(max_examples=300, deadline=None)
@given(_records, st.integers(0, SPARSE_EVERY - 1))
def test_blocks_read_back_as_the_rows_and_items_buffered(
    records: list[LogItem | LogMark], first: int
) -> None:
    data, offsets = _buffer(records)
    assert _buffer(records, first)[0] == data  # in runs or one at a time, the same bytes
    scanned = list(scan_bytes(data, 100))
    assert [row for _, _, row in scanned] == [to_row(r) for r in records]
    items = [r for r in records if isinstance(r, LogItem)]
    assert [offset - 100 for offset, _, row in scanned if row[0] == 0] == offsets
    runs: list[list[int]] = [[]]  # the item offsets of each run between marks
    for record, offset in zip(records, [o for o, _, _ in scanned], strict=True):
        if isinstance(record, LogItem):
            runs[-1].append(offset - 100)
        else:
            runs.append([])
    assert _buffer(records, first)[1] == [o for run in runs for o in run[first::SPARSE_EVERY]]
    assert scanned[-1][1] == 100 + len(data)
    out: list[LogItem] = []
    assert read_items(data, 100, out, 0, 2**64, 10**9, -1) == (100 + len(data), -1, False)
    assert out == _expected_read(items, 0, 2**64, 10**9, -1)[0]


def _expected_read(
    items: list[LogItem], after: int, upto: int, limit: int, left: int
) -> tuple[list[LogItem], int, bool]:
    """What ``VbLog.read`` reads of ``items``, one by one."""
    out = []
    for item in items:
        if item.by_seqno <= after:
            continue
        if item.by_seqno > upto:
            return out, left, True
        out.append(item)
        after = item.by_seqno
        if len(out) >= limit:
            return out, left, True
        if left >= 0:
            left -= len(item.key) + len(item.value)
            if left <= 0:
                return out, left, True
    return out, left, False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_items, min_size=1, max_size=20).map(
        lambda items: [i._replace(by_seqno=n + 1) for n, i in enumerate(items)]
    ),
    st.lists(_marks, max_size=3),
    st.integers(0, 21),
    st.integers(0, 21),
    st.integers(1, 21),
    st.integers(-1, 2000),
)
def test_a_read_takes_what_the_items_one_by_one_give(
    items: list[LogItem], marks: list[LogMark], after: int, upto: int, limit: int, left: int
) -> None:
    records: list[LogItem | LogMark] = [*items[:5], *marks, *items[5:]]
    expected, left_after, done = _expected_read(items, after, upto, limit, left)
    # In blocks, and as rows, one per item, as logs were written before blocks.
    for data in (_buffer(records)[0], b"".join(frame(to_row(r)) for r in records)):
        out: list[LogItem] = []
        _end, left_now, stopped = read_items(data, 0, out, after, upto, limit, left)
        assert (out, left_now, stopped) == (expected, left_after, done)


@settings(max_examples=300, deadline=None)
@given(_records, st.data())
def test_a_cut_block_is_a_torn_tail_and_a_flipped_bit_is_damage(
    records: list[LogItem | LogMark], data: st.DataObject
) -> None:
    whole, _ = _buffer(records)
    ends = [end for _, end, _ in scan_bytes(whole)]
    last = max([0] + [e for e in ends if e < len(whole)])
    cut = data.draw(st.integers(last, len(whole) - 1), label="cut")
    good = max([0] + [end for _, end, _ in scan_bytes(whole[:cut])])
    assert good == last and tail_fault(whole[:cut], good) is None
    bit = data.draw(st.integers(0, len(whole) * 8 - 1), label="bit")
    flipped = bytearray(whole)
    flipped[bit // 8] ^= 1 << bit % 8
    good = max([0] + [end for _, end, _ in scan_bytes(bytes(flipped))])
    assert good < len(whole) and tail_fault(bytes(flipped), good) is not None, (bit, good)
