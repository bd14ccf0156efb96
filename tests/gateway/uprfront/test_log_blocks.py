"""Blocks of items in the UPR front's log segments (``segments.buffer_item``).

For any run of items and marks buffered as the ingest buffers them (items in
blocks, a mark closing the open block, an item whose fields the block cannot
hold going as a row of its own), ``scan_bytes`` gives every record's row in
order, each item's at the offset ``buffer_item`` named for the sparse index,
``scan_items`` gives the items themselves, and a log written with a row per
item (before blocks) reads the same. A block is one record: cut short it is
a torn tail, a flipped bit anywhere in it is damage.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.translate.log_records import ItemKind, LogItem, LogMark, MarkKind, to_row
from gateway.uprfront.segments import (
    BLOCK_BYTES,
    buffer_item,
    close_block,
    frame,
    frame_mark,
    scan_bytes,
    scan_items,
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


def _buffer(records: list[LogItem | LogMark]) -> tuple[bytes, list[int]]:
    """The bytes the ingest buffers for ``records``, and each item's record offset."""
    buffer = bytearray()
    block = -1
    offsets = []
    for record in records:
        if isinstance(record, LogItem):
            block, at = buffer_item(buffer, block, record)
            offsets.append(at)
        else:
            close_block(buffer, block)
            block = -1
            buffer += frame_mark(record)
    close_block(buffer, block)
    return bytes(buffer), offsets


@settings(max_examples=300, deadline=None)
@given(_records)
def test_blocks_read_back_as_the_rows_and_items_buffered(records: list[LogItem | LogMark]) -> None:
    data, offsets = _buffer(records)
    scanned = list(scan_bytes(data, 100))
    assert [row for _, _, row in scanned] == [to_row(r) for r in records]
    items = [r for r in records if isinstance(r, LogItem)]
    assert [offset - 100 for offset, _, row in scanned if row[0] == 0] == offsets
    assert scanned[-1][1] == 100 + len(data)
    assert [item for _, item in scan_items(data, 100) if item is not None] == items
    assert [end for end, _ in scan_items(data, 100)][-1] == 100 + len(data)
    # The same records as rows, one per item, as logs were written before blocks.
    rows = b"".join(frame(to_row(r)) for r in records)
    assert [item for _, item in scan_items(rows) if item is not None] == items


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
