"""A memory snapshot's marker carries CHECKPOINT (0x04) when it begins a checkpoint, and only then.

The 3.0-era producer (couchbase/kv_engine 007528bb ``src/upr-stream.cc``,
the latest ``upr-*.cc`` copy found, with the ``DCP_*`` names; the first
``dcp-stream.cc`` copies keep the rule: membase/ep-engine 91e2f4f,
jimwwalker/ep-engine 00553ca, daverigby/ep-engine 866b7c0) cuts memory
snapshots in ``ActiveStream::nextCheckpointItem``: the items the cursor
reads are split at every ``queue_op_checkpoint_start``, and
``ActiveStream::snapshot`` sets ``MARKER_FLAG_CHK`` when the cursor's items
began with that checkpoint start (``mark``). So a snapshot gets 0x05 when its
first item is the first of a checkpoint, 0x01 when the read began inside one
(a later read of the same checkpoint); ``ActiveStream::markDiskSnapshot``
sends DISK (0x02) alone, and the takeover-send phase adds ACK (0x08). Its
consumer (``PassiveStream::processMarker``, same file) opens a new checkpoint
on a memory marker only with that flag. Earlier copies with the ``UPR_*``
names (hisundar/ep-engine 8d0998d, mikewied/ep-engine 297b2ec) sent MEMORY
alone; see docs/protocol-facts.md.

Here the checkpoints are TAP's (a CHECKPOINT_START's first item), and the
rule is checked on every path a log item reaches a consumer by: the event
path (``cut_snapshots``), the in-memory fast path (``BatchEncoder.encode``),
a read's (``BatchCut.rows``) and the ingest's preframing (``Framing``, through
``WriteBuffer``), for reads that start anywhere and stop anywhere. The node's
streams are checked in tests/gateway/node/test_node_upr_producer.py.
"""

from __future__ import annotations

import pytest

from adapters import upr
from adapters.mcbp import FrameReader
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapMutation,
    TapOpaque,
    TapStreamMessage,
    encode,
)
from adapters.translate.log_records import LogItem, LogMark
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from adapters.translate.tap_to_log_fast import log_buffer
from adapters.translate.tap_to_upr import TapToUpr
from adapters.translate.upr_snapshots import cut_snapshots
from adapters.upr.dialect import DCP
from gateway.fronts.upr.write_buffer import WriteBuffer

SF = upr.SnapshotFlags
VB = 3
OPAQUE = 0x77
NOW = 1_700_000_000.0
_NO_END = 2**62


def _mutation(key: bytes, cas: int) -> TapMutation:
    return TapMutation(key, b"v%d" % cas, vbucket=VB, cas=cas, rev_seqno=1, nru=0)


# A 2.5.1 producer with the CHECKPOINT flag: a backfill, then checkpoints,
# one of them empty, and a key written twice in the last one.
SCRIPT: list[TapStreamMessage] = [
    TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, VB),
    _mutation(b"a", 1),  # 1
    _mutation(b"b", 2),  # 2
    TapOpaque(OpaqueCode.CLOSE_BACKFILL, VB),
    TapCheckpointStart(5, vbucket=VB),
    _mutation(b"c", 3),  # 3
    _mutation(b"d", 4),  # 4
    TapCheckpointEnd(5, vbucket=VB),
    TapCheckpointStart(6, vbucket=VB),
    _mutation(b"e", 5),  # 5
    _mutation(b"f", 6),  # 6
    _mutation(b"g", 7),  # 7
    TapCheckpointEnd(6, vbucket=VB),
    TapCheckpointStart(7, vbucket=VB),
    TapCheckpointEnd(7, vbucket=VB),
    TapCheckpointStart(8, vbucket=VB),
    _mutation(b"h", 8),  # 8
    _mutation(b"h", 9),  # 9: the key again, a new snapshot inside checkpoint 8
]
BACKFILL = {1, 2}
CHECKPOINT_FIRST = {3, 5, 8}
"""Seqnos whose item is the first of its checkpoint."""
CHECKPOINT_OF = {1: 0, 2: 0, 3: 5, 4: 5, 5: 6, 6: 6, 7: 6, 8: 8, 9: 8}
KEY_OF = dict(enumerate([b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"h"], start=1))


def _expected(after: int, upto: int) -> list[tuple[int, int, int]]:
    """(start, end, flags) of the snapshots of a read of seqnos after..upto, by the rule."""
    out: list[tuple[int, int, int]] = []
    keys: set[bytes] = set()
    for seqno in range(after + 1, upto + 1):
        if out:
            start, _, flags = out[-1]
            if (
                (seqno in BACKFILL) == (start in BACKFILL)
                and CHECKPOINT_OF[seqno] == CHECKPOINT_OF[start]
                and seqno not in CHECKPOINT_FIRST
                and KEY_OF[seqno] not in keys
            ):
                out[-1] = (start, seqno, flags)
                keys.add(KEY_OF[seqno])
                continue
        if seqno in BACKFILL:
            flags = SF.DISK
        elif seqno in CHECKPOINT_FIRST:
            flags = SF.MEMORY | SF.CHECKPOINT
        else:
            flags = SF.MEMORY
        out.append((seqno, seqno, int(flags)))
        keys = {KEY_OF[seqno]}
    return out


def _log() -> list[LogItem]:
    translator = TapToUpr(VB)
    items: list[LogItem] = []
    for message in SCRIPT:
        items.extend(r for r in translator.feed(message, NOW) if isinstance(r, LogItem))
    assert [i.by_seqno for i in items] == list(range(1, 10))
    return items


def _markers(data: bytes) -> list[tuple[int, int, int]]:
    reader = FrameReader()
    reader.receive_data(data)
    out = []
    while (frame := reader.next_frame()) is not None:
        event = upr.decode_frame(frame, DCP)
        if isinstance(event, upr.SnapshotMarker):
            out.append((event.start_seqno, event.end_seqno, int(event.flags)))
    return out


READS = [(after, upto) for after in range(0, 9) for upto in range(after + 1, 10)]


@pytest.mark.parametrize(("after", "upto"), READS)
def test_every_path_flags_the_snapshot_that_begins_a_checkpoint(after: int, upto: int) -> None:
    items = _log()[after:upto]
    want = _expected(after, upto)
    event_path = [(s.start, s.end, int(s.flags)) for s in cut_snapshots(items)]
    assert event_path == want
    assert _markers(BatchEncoder(DCP, OPAQUE, VB).encode(items).data) == want
    cut = BatchCut(BatchEncoder(DCP, OPAQUE, VB), after, upto, _NO_END, _NO_END)
    cut.rows(items)
    assert _markers(cut.finish().data) == want


def test_takeover_send_markers_add_ack_to_the_rule() -> None:
    """``ActiveStream::snapshot``: ``flags |= MARKER_FLAG_ACK`` in STREAM_TAKEOVER_SEND."""
    snaps = cut_snapshots(_log()[2:], extra=SF.ACK)
    assert [int(s.flags) for s in snaps] == [0x0D, 0x0D, 0x0D, 0x09]


def test_the_ingest_preframes_the_same_markers() -> None:
    """``Framing`` (the ingest fast path's framing of a write) flags as a read does."""
    translator = TapToUpr(VB)
    sink = _Sink(translator)
    sink.buffer.frame_for(BatchEncoder(DCP, OPAQUE, VB))
    for message in SCRIPT:
        frame = encode(message)
        offset, taken = log_buffer(frame, 0, {VB: sink}, NOW, {}, [])
        if not taken:  # backfill opaques and checkpoint marks: the event path's
            assert offset == 0
            for record in translator.feed(message, NOW):
                if isinstance(record, LogItem):
                    sink.buffer.add_items([record])
                else:
                    assert isinstance(record, LogMark)
                    sink.buffer.add_mark(record)
    sink.buffer.close_block()
    framed = sink.buffer.framed()
    assert framed is not None
    assert _markers(framed[0]) == _expected(0, 9)


class _Sink:
    """What ``log_buffer`` takes for a vbucket: its translator and write buffer."""

    def __init__(self, translator: TapToUpr) -> None:
        self.translator = translator
        self.buffer = WriteBuffer()


def test_expected_reads_cover_each_case() -> None:
    flags = {f for after, upto in READS for _, _, f in _expected(after, upto)}
    assert flags == {0x02, 0x01, 0x05}
