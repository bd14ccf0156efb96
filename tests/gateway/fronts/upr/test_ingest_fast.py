"""The UPR front's ingest logs the same records on its fast path as on the event path.

The event path (``decode_frame``, ``TapToUpr.feed``, ``VbLog.ingest``, ``ack_of``)
is the reference: for any generated TAP stream of a few vbuckets (items with
and without rev_seqno, duplicates, deletes that are expirations, backfill and
checkpoint structure, NOOPs, malformed item and checkpoint frames), cut into socket reads at
any byte (mid-frame included), ``Ingest._apply_read`` (the fast path,
``adapters.translate.tap_to_log_fast``) must answer the same acks and
replies per read, fail on the same frame with the same error, count the same
messages, and leave byte-identical segment files and the same ingest state.
An item's record (``frame_item``), and a mark's (``frame_mark``), is the record
of its row (``frame(to_row)``).
"""

from __future__ import annotations

import tempfile
from itertools import pairwise
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.errors import GatewayError
from adapters.mcbp import FrameReader
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapMutation,
    TapNoop,
    TapOpaque,
    TapOpcode,
    TapResponse,
    encode,
)
from adapters.translate.log_records import ItemKind, LogItem, LogMark, MarkKind, from_row, to_row
from adapters.translate.tap_to_log_fast import ack_frame, frame_end
from gateway.fronts.upr import write_buffer
from gateway.fronts.upr.config import UprFrontConfig
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.segments import frame, frame_item, frame_mark, scan_bytes
from gateway.metrics.figures import GatewayStats

NOW = 1_700_000_000.0
VBUCKETS = (0, 7, 1023)
KEYS = [b"k%d" % n for n in range(6)]

_flags = st.sampled_from([0, int(TapFlags.ACK), int(TapFlags.NETWORK_BYTE_ORDER), 0x05])
_rev = st.one_of(st.none(), st.integers(1, 3))
_vb = st.sampled_from(VBUCKETS)


def _mutation(draw: st.DrawFn) -> bytes:
    rev = draw(_rev)
    return encode(
        TapMutation(
            draw(st.sampled_from(KEYS)),
            draw(st.binary(max_size=20)),
            vbucket=draw(_vb),
            opaque=draw(st.integers(0, 2**32 - 1)),
            cas=draw(st.integers(1, 3)),
            flags=draw(st.integers(0, 2**32 - 1)),
            expiration=draw(st.sampled_from([0, int(NOW) - 5, int(NOW) + 3600])),
            rev_seqno=rev,
            nru=draw(st.none() | st.integers(0, 2)) if rev is not None else None,
            tap_flags=TapFlags(draw(_flags)),
            datatype=draw(st.integers(0, 1)),
        )
    )


def _delete(draw: st.DrawFn) -> bytes:
    return encode(
        TapDelete(
            draw(st.sampled_from(KEYS)),
            vbucket=draw(_vb),
            opaque=draw(st.integers(0, 2**32 - 1)),
            cas=draw(st.integers(1, 3)),
            rev_seqno=draw(_rev),
            tap_flags=TapFlags(draw(_flags)),
        )
    )


def _checkpoint(draw: st.DrawFn) -> bytes:
    cls = draw(st.sampled_from([TapCheckpointStart, TapCheckpointEnd]))
    return encode(
        cls(
            draw(st.integers(1, 4)),
            vbucket=draw(_vb),
            opaque=draw(st.integers(0, 2**32 - 1)),
            tap_flags=TapFlags(draw(_flags)),
        )
    )


def _damaged(draw: st.DrawFn) -> bytes:
    """An item or checkpoint frame with a wrong engine-specific length, or no key."""
    data = bytearray(draw(st.sampled_from([_mutation, _delete, _checkpoint]))(draw))
    if draw(st.booleans()):
        data[24:26] = draw(st.sampled_from([1, 7, 10, 300, 65535])).to_bytes(2, "big")
    else:
        data[2:4] = b"\0\0"
    return bytes(data)


def _control(draw: st.DrawFn) -> bytes:
    vb = draw(_vb)
    flags = TapFlags(draw(st.sampled_from([0, int(TapFlags.ACK)])))
    checkpoint = draw(st.integers(1, 4))
    return encode(
        draw(
            st.sampled_from(
                [
                    TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, vb, 9, flags),
                    TapOpaque(OpaqueCode.CLOSE_BACKFILL, vb, 10, flags),
                    TapCheckpointStart(checkpoint, vbucket=vb, opaque=11, tap_flags=flags),
                    TapCheckpointEnd(checkpoint, vbucket=vb, opaque=12, tap_flags=flags),
                    TapNoop(13),
                ]
            )
        )
    )


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A TAP stream's bytes and where socket reads end."""
    kinds = [_mutation] * 6 + [_delete] * 3 + [_control] * 2 + [_checkpoint] * 2
    if draw(st.integers(0, 9)) == 0:
        kinds.append(_damaged)
    frames = [draw(st.sampled_from(kinds))(draw) for _ in range(draw(st.integers(1, 40)))]
    data = b"".join(frames)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8))))
    return data, cuts


def _ingest(root: Path, fast: bool, fsync: str = "never") -> Ingest:
    config = UprFrontConfig(("127.0.0.1", 0), ("127.0.0.1", 0), root, fsync=fsync)
    logs = LogSet(root, LogOptions(fsync=fsync, segment_bytes=4096), GatewayStats(), seed=1)
    ingest = Ingest(config, logs, GatewayStats(), vbuckets=VBUCKETS)
    ingest.fast = fast
    ingest.clock = lambda: NOW
    return ingest


async def _feed(ingest: Ingest, reads: list[bytes]) -> list[object]:
    """Per read: the bytes ``_apply`` answers, or the error that stopped the stream."""
    stream, _peer = trio.testing.memory_stream_pair()
    reader = FrameReader(lenient_responses=True)
    out: list[object] = []
    rest = b""  # the fast path frames each read in place, carrying a partial frame over
    for data in reads:
        try:
            if not ingest.fast:
                reader.receive_data(data)
                out.append(b"".join(await ingest._apply(reader.frames(), stream)))
                continue
            rest += data
            if frame_end(rest, 0, reader.lenient_responses) is None:
                out.append(b"")
                continue
            replies, used = await ingest._apply_read(rest, reader, stream)
            rest = rest[used:]
            out.append(b"".join(replies))
        except GatewayError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
            break
    ingest.logs.close()
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("vb-*/*.seg"))}


def _state(ingest: Ingest) -> list[object]:
    out: list[object] = [ingest.messages]
    for vb, vblog in sorted(ingest.logs.logs.items()):
        t = vblog.translator
        out.append((vb, t.high_seqno, t.index, t.duplicates, t.in_backfill, t.checkpoint_id,
                    vblog.items_total, vblog.read(0, 2**62, 10**6),
                    [(s.first, s.last, s.count, s.sparse) for s in vblog.segments]))  # fmt: skip
    return out


# "always" commits after each item, so the fast path goes frame by frame there. Small
# blocks and a dense sparse index: the fast path packs items into the write buffer
# itself (``WriteBuffer``), block splits and index entries included.
@pytest.mark.parametrize(("fsync", "small"), [("never", False), ("always", False), ("never", True)])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams())
def test_fast_path_logs_and_acks_what_the_event_path_does(
    fsync: str, small: bool, stream: tuple[bytes, list[int]]
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        if small:
            patch.setattr(write_buffer, "BLOCK_BYTES", 85)
            patch.setattr(write_buffer, "SPARSE_EVERY", 3)
        _compare_paths(fsync, stream)


def _compare_paths(fsync: str, stream: tuple[bytes, list[int]]) -> None:
    data, cuts = stream
    reads = [data[a:b] for a, b in pairwise([0, *cuts, len(data)])]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fast in (False, True):
            root = Path(tmp) / str(fast)
            ingest = _ingest(root, fast, fsync)
            answered = trio.run(_feed, ingest, reads)
            results.append((answered, _state(ingest), _files(root)))
    assert results[0] == results[1]


def test_ack_frame_is_the_codecs_ack() -> None:
    for opcode in (
        TapOpcode.MUTATION,
        TapOpcode.DELETE,
        TapOpcode.CHECKPOINT_START,
        TapOpcode.CHECKPOINT_END,
    ):
        for opaque in (0, 1, 2**32 - 1):
            assert ack_frame(opcode.value, opaque) == encode(TapResponse(opcode, opaque, 0))


_items = st.builds(
    LogItem,
    st.integers(1, 2**64 - 1),
    st.sampled_from(list(ItemKind)),
    st.binary(min_size=1, max_size=250),
    st.binary(max_size=300),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 255),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.booleans(),
    st.floats(0, 2e9),
    st.integers(0, 2**32 - 1),
)


@given(_items)
def test_an_items_record_is_the_rows_record(item: LogItem) -> None:
    data = frame_item(item)
    assert data == frame(to_row(item))
    assert [from_row(row) for _, _, row in scan_bytes(data, 0)] == [item]


@given(st.sampled_from(list(MarkKind)), st.integers(0, 2**64 - 1))
def test_a_marks_record_is_the_rows_record(kind: MarkKind, value: int) -> None:
    mark = LogMark(kind, value)
    data = frame_mark(mark)
    assert data == frame(to_row(mark))
    assert [from_row(row) for _, _, row in scan_bytes(data, 0)] == [mark]
