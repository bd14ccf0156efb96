"""Log items to snapshots: exact brackets, unique keys, flags by origin and checkpoint."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.errors import LocalProtocolError
from adapters.mcbp import Frame, FrameReader
from adapters.translate.log_records import ItemKind, LogItem
from adapters.translate.upr_snapshots import ItemEncoder, cut_snapshots, item_event

SF = upr.SnapshotFlags


def item(seqno: int, key: bytes, *, backfill: bool = False, cp: int = 1, first: bool = False,
         kind: ItemKind = ItemKind.MUTATION) -> LogItem:  # fmt: skip
    return LogItem(seqno, kind, key, b"v", checkpoint_id=0 if backfill else cp, backfill=backfill,
                   checkpoint_start=first)  # fmt: skip


def test_backfill_then_checkpoints() -> None:
    snaps = cut_snapshots(
        [
            item(1, b"a", backfill=True),
            item(2, b"b", backfill=True),
            item(3, b"a", cp=4, first=True),
            item(4, b"c", cp=4),
            item(5, b"c", cp=4),
            item(6, b"d", cp=5, first=True),
        ]
    )
    assert [(s.start, s.end, s.flags) for s in snaps] == [
        (1, 2, SF.DISK),
        (3, 4, SF.MEMORY | SF.CHECKPOINT),
        (5, 5, SF.MEMORY),
        (6, 6, SF.MEMORY | SF.CHECKPOINT),
    ]


def test_ack_flag_is_added() -> None:
    (snap,) = cut_snapshots([item(1, b"a")], extra=SF.ACK)
    assert snap.flags == SF.MEMORY | SF.ACK


def test_item_events_by_consumer_settings() -> None:
    exp = item(9, b"k", kind=ItemKind.EXPIRATION)
    assert isinstance(item_event(exp, 1, 2), upr.Deletion)
    event = item_event(exp, 1, 2, expiry_opcode=True, delete_times=True)
    assert isinstance(event, upr.Expiration) and event.delete_time == 0 and event.vbucket == 2
    assert isinstance(item_event(item(1, b"k"), 1, 2), upr.Mutation)


runs = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"b", b"c", b"d"]), st.booleans(), st.integers(0, 3), st.booleans()
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(runs, st.integers(1, 5))
def test_snapshots_partition_the_batch_exactly(rows: list, gap: int) -> None:
    batch = []
    seqno = 0
    for key, backfill, cp, first in rows:
        seqno += gap
        batch.append(item(seqno, key, backfill=backfill, cp=cp, first=first))
    snaps = cut_snapshots(batch)
    assert [i for s in snaps for i in s.items] == batch
    for s in snaps:
        assert s.items and (s.start, s.end) == (s.items[0].by_seqno, s.items[-1].by_seqno)
        assert len({i.key for i in s.items}) == len(s.items)
        assert len({(i.backfill, i.checkpoint_id) for i in s.items}) == 1
        assert not any(i.checkpoint_start and not i.backfill for i in s.items[1:])
        assert bool(s.flags & SF.DISK) == s.items[0].backfill
        assert bool(s.flags & SF.MEMORY) != bool(s.flags & SF.DISK)
        flagged = s.items[0].checkpoint_start and not s.items[0].backfill
        assert bool(s.flags & SF.CHECKPOINT) == flagged


U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
log_items = st.builds(
    LogItem,
    by_seqno=U64,
    kind=st.sampled_from(list(ItemKind)),
    key=st.binary(min_size=0, max_size=12),
    value=st.binary(max_size=40),
    rev_seqno=U64,
    cas=U64,
    flags=U32,
    expiration=U32,
    lock_time=U32,
    datatype=st.integers(0, 255),
    delete_time=U32,
)


@settings(max_examples=400, deadline=None)
@given(
    log_items,
    st.sampled_from([upr.DCP, upr.UPR_DRAFT]),
    U32,
    st.integers(0, 0xFFFF),
    st.booleans(),
    st.booleans(),
)
def test_item_encoder_sends_exactly_what_the_codec_encodes(
    it: LogItem, dialect: upr.Dialect, opaque: int, vb: int, expiry: bool, times: bool
) -> None:
    encoder = ItemEncoder(dialect, opaque, vb, expiry_opcode=expiry, delete_times=times)
    event = item_event(it, opaque, vb, expiry_opcode=expiry, delete_times=times)
    try:
        want = upr.encode(event, dialect)
    except LocalProtocolError as exc:
        # What the codec refuses (an empty key, a layout the dialect lacks)
        # the encoder refuses the same way.
        with pytest.raises(LocalProtocolError, match=re.escape(str(exc))):
            encoder.encode(it)
        return
    got = encoder.encode(it)
    assert got == want
    assert upr.decode_frame(_only(got), dialect) == event


def _only(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    (frame,) = reader.frames()
    return frame
