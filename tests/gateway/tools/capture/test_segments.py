"""Segment files: round trips, rotation, torn tails and damage."""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from gateway.tools.capture import (
    CaptureRecord,
    Kind,
    SegmentError,
    SegmentWriter,
    decode_segment,
    item_record,
    list_segments,
    marker_record,
    read_segment,
)
from gateway.tools.capture.segments import encode_block, encode_header

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
maybe_u64 = st.none() | u64

records = st.builds(
    CaptureRecord,
    kind=st.sampled_from([int(k) for k in Kind]),
    vbucket=st.integers(0, 1023),
    key=st.binary(max_size=40),
    by_seqno=maybe_u64,
    rev_seqno=maybe_u64,
    cas=u64,
    flags=u32,
    expiration=u32,
    digest=st.none() | st.binary(min_size=16, max_size=16),
    checkpoint_id=maybe_u64,
    snap_start=maybe_u64,
    snap_end=maybe_u64,
    marker_flags=u32,
    arrival=st.floats(0, 4e9, allow_nan=False),
)
META = {"schema": 1, "side": "upr", "connection": "c", "direction": "received", "segment": 0}


def segment_bytes(blocks: list[list[CaptureRecord]]) -> bytes:
    return encode_header(META) + b"".join(encode_block(b) for b in blocks)


@given(st.lists(st.lists(records, min_size=1, max_size=8), max_size=5))
def test_round_trip(blocks: list[list[CaptureRecord]]) -> None:
    segment = decode_segment(segment_bytes(blocks))
    assert segment.torn is None
    assert segment.meta == META
    assert segment.typed() == [r for block in blocks for r in block]


@given(st.lists(st.lists(records, min_size=1, max_size=6), min_size=1, max_size=4), st.data())
def test_torn_tail_keeps_every_whole_record_before_the_cut(
    blocks: list[list[CaptureRecord]], data: st.DataObject
) -> None:
    whole = segment_bytes(blocks)
    header = len(encode_header(META))
    cut = data.draw(st.integers(header + 1, len(whole) - 1), label="cut")
    segment = decode_segment(whole[:cut])
    everything = [r for block in blocks for r in block]
    got = segment.typed()
    # A prefix of what was written: nothing invented, nothing reordered.
    assert got == everything[: len(got)]
    offset, before, boundaries = header, 0, {header}
    for block in blocks:
        offset += len(encode_block(block))
        boundaries.add(offset)
        if offset <= cut:
            before += len(block)
    # Everything in blocks wholly before the cut survives.
    assert len(got) >= before
    if cut in boundaries:  # a cut between blocks leaves a shorter, sound segment
        assert segment.torn is None and len(got) == before
    else:
        assert segment.torn is not None and segment.torn.lost_bytes > 0
        assert "torn last block" in segment.torn.describe()


def test_damage_before_the_last_block_is_an_error_naming_the_offset() -> None:
    one = [item_record(1, b"k", "mutation", by_seqno=1, rev_seqno=1, cas=1, value=b"v", arrival=0)]
    data = bytearray(segment_bytes([one, one]))
    header = len(encode_header(META))
    data[header + 14] ^= 0xFF  # inside the first block's payload
    with pytest.raises(SegmentError, match=f"checksum at offset {header}"):
        decode_segment(bytes(data), "seg")


def test_damage_in_the_last_block_is_reported_as_torn() -> None:
    one = [item_record(1, b"k", "mutation", by_seqno=1, rev_seqno=1, cas=1, value=b"v", arrival=0)]
    data = bytearray(segment_bytes([one, one]))
    data[-1] ^= 0xFF
    segment = decode_segment(bytes(data))
    assert len(segment.records) == 1
    assert segment.torn is not None and "checksum" in segment.torn.reason


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "too short"),
        (b"NOTACAPTURE-FILE-AT-ALL", "not a capture segment"),
        (b"TUCAPSEG\x00\x09\x00\x00\x00\x00", "unsupported schema version 9"),
        (b"TUCAPSEG\x00\x01\x00\x00\x10\x00", "metadata length 4096"),
    ],
)
def test_not_a_segment(data: bytes, match: str) -> None:
    with pytest.raises(SegmentError, match=match):
        decode_segment(data, "x")


def test_records_of_the_wrong_shape_are_refused() -> None:
    block = encode_block([[1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(SegmentError, match="not a 14-field array"):
        decode_segment(encode_header(META) + block + encode_block([]), "x")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=20)
@given(st.lists(records, max_size=300))
def test_writer_rotates_and_reads_back_in_order(tmp_path: Path, rs: list[CaptureRecord]) -> None:
    directory = tmp_path / f"w{len(list(tmp_path.iterdir()))}"
    writer = SegmentWriter(
        directory,
        side="tap",
        connection="127.0.0.1:1234 client/é",
        direction="sent",
        max_segment_bytes=4096,
        block_records=16,
    )
    writer.write(rs[: len(rs) // 2])
    writer.write(rs[len(rs) // 2 :])
    writer.close()
    paths = list_segments(directory)
    assert paths == writer.paths
    got: list[CaptureRecord] = []
    for number, path in enumerate(paths):
        segment = read_segment(path)
        assert segment.torn is None
        assert segment.meta["segment"] == number
        assert segment.meta["side"] == "tap" and segment.meta["direction"] == "sent"
        assert segment.meta["connection"] == "127.0.0.1:1234 client/é"
        got.extend(segment.typed())
    assert got == rs
    if len(rs) > 200:
        assert len(paths) > 1


def test_empty_writer_leaves_a_header_only_segment(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, side="upr", connection="idle", direction="received")
    writer.close()
    (path,) = list_segments(tmp_path)
    segment = read_segment(path)
    assert segment.records == [] and segment.torn is None
    assert segment.meta["connection"] == "idle"


def test_record_builders_check_their_kind() -> None:
    with pytest.raises(ValueError, match="boundary"):
        item_record(0, b"k", Kind.SNAPSHOT, by_seqno=1, rev_seqno=1, cas=0, arrival=0)
    with pytest.raises(ValueError, match="item kind"):
        marker_record(0, "mutation", arrival=0)
    with pytest.raises(ValueError, match="unknown record kind 'bogus'"):
        marker_record(0, "bogus", arrival=0)
    deleted = item_record(0, b"k", "deletion", by_seqno=2, rev_seqno=2, cas=5, value=b"", arrival=1)
    assert deleted.digest is None and deleted.kind == Kind.DELETION


def test_a_segment_never_appears_without_its_header(tmp_path: Path) -> None:
    """A reader of a capture in progress (``read_capture`` while the recorder runs)
    finds every listed segment readable: the file is named only once its header is
    on disk, and the name readers skip while it is written is gone after."""
    seen: list[list[Path]] = []
    real_link = os.link

    def link_and_look(src: str | Path, dst: str | Path) -> None:
        seen.append(list_segments(tmp_path))  # just before the name appears
        real_link(src, dst)
        seen.append(list_segments(tmp_path))  # just after
        assert read_segment(dst).records == []  # the header alone, whole

    writer = SegmentWriter(tmp_path, side="upr", connection="c", direction="received")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "link", link_and_look)
        writer.close()  # a connection that saw nothing still leaves its (empty) segment
    assert seen[0] == [] and len(seen[1]) == 1
    assert [p.name for p in tmp_path.iterdir()] == [seen[1][0].name]
    assert read_segment(seen[1][0]).meta["connection"] == "c"
