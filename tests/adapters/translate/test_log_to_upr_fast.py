"""The serving fast path sends byte for byte what the event path sends.

Any generated log (every item kind, repeated keys, backfill and checkpoint
origins, numbers up to their field limits), read in any batch split, with
delete times on or off (UPR OPEN flag 0x20, ep-engine v3.0.0
src/upr-producer.cc) and the expiry opcode on or off, and cut by any
flow-control window (ep-engine v3.0.0 src/upr-producer.cc ``BufferLog``:
a producer stops once the unacked bytes reach the buffer size, so the last
message may overshoot it).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.errors import LocalProtocolError
from adapters.translate.log_records import ItemKind, LogItem
from adapters.translate.log_to_upr_fast import BatchEncoder
from adapters.translate.upr_snapshots import ItemEncoder, cut_snapshots

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)

rows = st.tuples(
    st.sampled_from(list(ItemKind)),
    st.sampled_from([b"a", b"b", b"key-c", b"d" * 30]),
    st.binary(max_size=30),
    st.booleans(),  # backfill
    st.integers(0, 3),  # checkpoint id
    st.booleans(),  # checkpoint start
    st.tuples(U64, U64, U32, U32, U32, st.integers(0, 255), U32),
)


def build(generated: list, gaps: list[int]) -> list[LogItem]:
    items, seqno = [], 0
    for (kind, key, value, backfill, cp, first, nums), gap in zip(generated, gaps, strict=False):
        seqno += gap
        rev, cas, flags, exp, lock, dtype, dtime = nums
        items.append(LogItem(seqno, kind, key, value if kind is ItemKind.MUTATION else b"", rev,
                             cas, flags, exp, lock, dtype, 0 if backfill else cp, backfill, first,
                             0.0, dtime))  # fmt: skip
    return items


def event_path(items: list[LogItem], encoder: ItemEncoder) -> list[tuple[bytes, LogItem | None]]:
    """What ``LogStream._send_batch`` sends on the event path: (message, item or None)."""
    out: list[tuple[bytes, LogItem | None]] = []
    for snap in cut_snapshots(items):
        marker = upr.SnapshotMarker(snap.start, snap.end, snap.flags, opaque=encoder.opaque,
                                    vbucket=encoder.vbucket)  # fmt: skip
        out.append((upr.encode(marker), None))
        out.extend((encoder.encode(item), item) for item in snap.items)
    return out


def window_writes(
    messages: list[tuple[bytes, LogItem | None]], rooms: list[int]
) -> list[tuple[bytes, int, int]]:
    """(bytes, items, last item seqno) per write of ``UprConnection.send_messages``:
    whole messages while the window had room before each."""
    writes, start, turn = [], 0, 0
    while start < len(messages):
        room = rooms[turn % len(rooms)]
        turn += 1
        end, taken = start, 0
        while end < len(messages) and (taken < room or end == start):
            taken += len(messages[end][0])
            end += 1
        sent = [item for _, item in messages[start:end] if item is not None]
        data = b"".join(message for message, _ in messages[start:end])
        writes.append((data, len(sent), sent[-1].by_seqno if sent else 0))
        start = end
    return writes


@settings(max_examples=400, deadline=None)
@given(
    st.lists(rows, max_size=60),
    st.lists(st.integers(1, 3), min_size=60, max_size=60),
    st.lists(st.integers(1, 60), min_size=1, max_size=8),
    U32,
    st.integers(0, 0xFFFF),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(1, 400), min_size=1, max_size=6),
)
def test_fast_path_sends_what_the_event_path_sends(
    generated: list,
    gaps: list[int],
    splits: list[int],
    opaque: int,
    vb: int,
    expiry: bool,
    times: bool,
    rooms: list[int],
) -> None:
    log = build(generated, gaps)
    fast = BatchEncoder(upr.DCP, opaque, vb, expiry_opcode=expiry, delete_times=times)
    slow = ItemEncoder(upr.DCP, opaque, vb, expiry_opcode=expiry, delete_times=times)
    at, turn = 0, 0
    while at < len(log):
        batch = log[at : at + splits[turn % len(splits)]]
        turn += 1
        at += len(batch)
        messages = event_path(batch, slow)
        encoded = fast.encode(batch)
        assert encoded.data == b"".join(m for m, _ in messages)
        assert encoded.markers == sum(1 for _, i in messages if i is None)
        kinds = [i.kind for _, i in messages if i is not None]
        assert encoded.deletions == kinds.count(ItemKind.DELETION)
        assert encoded.expirations == kinds.count(ItemKind.EXPIRATION)
        writes, start, turn_w = [], 0, 0
        while start < len(encoded.data):
            end, count, last = fast.split(encoded.data, start, rooms[turn_w % len(rooms)])
            turn_w += 1
            writes.append((encoded.data[start:end], count, last))
            start = end
        assert writes == window_writes(messages, rooms)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(list(ItemKind)),
    st.binary(max_size=4),
    st.integers(1, 2**64 - 1),
    st.integers(0, 2**33),
    st.booleans(),
    st.booleans(),
)
def test_what_cannot_be_encoded_fails_as_on_the_event_path(
    kind: ItemKind, key: bytes, seqno: int, flags: int, expiry: bool, times: bool
) -> None:
    item = LogItem(seqno, kind, key, b"v" if kind is ItemKind.MUTATION else b"",
                   flags=flags, delete_time=flags)  # fmt: skip
    fast = BatchEncoder(upr.DCP, 7, 3, expiry_opcode=expiry, delete_times=times)
    slow = ItemEncoder(upr.DCP, 7, 3, expiry_opcode=expiry, delete_times=times)
    try:
        want = b"".join(m for m, _ in event_path([item], slow))
    except LocalProtocolError as exc:
        with pytest.raises(LocalProtocolError, match=re.escape(str(exc))):
            fast.encode([item])
        return
    assert fast.encode([item]).data == want


def test_the_draft_dialect_keeps_the_event_path() -> None:
    with pytest.raises(ValueError, match="SNAPSHOT_MARKER"):
        BatchEncoder(upr.UPR_DRAFT, 1, 0)
