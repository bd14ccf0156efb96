"""Writes the ingest frames for the stream that follows a log are what that stream's read frames.

``adapters.translate.log_preframing``: while the fast path logs a vbucket's
items it may pack their UPR messages for one stream encoder. For any
generated TAP stream (items with duplicate keys, deletes, backfill and
checkpoint structure, control frames the event path takes), logged in steps
of any size and written at any step, every write that comes out framed must
be exactly what ``BatchCut`` frames from that write's records read from its
first item to its last (bytes, markers, items, last seqno, arrival, and the
keys' and values' bytes). Through a ``VbLog``, the stream whose encoder it is
takes the framed write from the in-memory tail (``BatchCut.adopt``) and gets
what any other stream's walk of the same records gets.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from adapters.mcbp import FrameReader
from adapters.tap import TapMutation, TapOpaque, encode
from adapters.tap.constants import OpaqueCode
from adapters.tap.consumer_machine import Do, TapConsumerMachine
from adapters.translate.log_records import LogItem
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from adapters.translate.tap_to_log_fast import frame_end, log_buffer
from adapters.translate.tap_to_upr import TapToUpr
from adapters.upr.dialect import DCP
from gateway.fronts.upr.segments import walk_records
from gateway.fronts.upr.vblog import VbLog
from gateway.fronts.upr.write_buffer import WriteBuffer
from tests.gateway.fronts.upr.test_ingest_fast import (
    _checkpoint,
    _control,
    _delete,
    _mutation,
)

NOW = 1_700_000_000.0
VBUCKETS = (0, 7, 1023)
_NO_END = 2**62


class _Sink:
    def __init__(self, vbucket: int) -> None:
        self.translator = TapToUpr(vbucket)
        self.buffer = WriteBuffer()


@st.composite
def _frames(draw: st.DrawFn) -> list[bytes]:
    """Mostly items (deletes rarer, so that writes of items alone come often)."""
    kinds = [_mutation] * 12 + [_delete] + [_control] * 2 + [_checkpoint] * 2
    return [draw(st.sampled_from(kinds))(draw) for _ in range(draw(st.integers(1, 60)))]


def _walked(encoder: BatchEncoder, data: bytes, first: int, last: int) -> tuple[object, ...]:
    """What a read of the write ``data`` (items ``first`` to ``last``) frames."""
    cut = BatchCut(encoder, first - 1, last, _NO_END, _NO_END)
    walk_records(data, 0, cut, verify=False)
    left = cut.left
    batch = cut.finish()
    return batch.data, batch.markers, batch.items, batch.last, batch.arrival, _NO_END - left


def _event_path(sinks: dict[int, _Sink], machine: TapConsumerMachine, frame: bytes) -> bool:
    """Apply one frame as ``VbLog.ingest`` does; False once the stream cannot go on."""
    reader = FrameReader(lenient_responses=True)
    reader.receive_data(frame)
    try:
        decoded = reader.next_frame()
        if decoded is None:
            return False
        decision = machine.receive_frame(decoded)
    except Exception:  # a frame the reader or the machine refuses: the stream ends there
        return False
    message = decision.message
    if decision.do is not Do.APPLY or message is None or message.vbucket not in sinks:
        return decision.do is not Do.CLOSE
    sink = sinks[message.vbucket]
    for record in sink.translator.feed(message, NOW):
        if type(record) is LogItem:
            sink.buffer.add_items([record])
        else:
            sink.buffer.add_mark(record)  # type: ignore[arg-type]
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=_frames(), steps=st.lists(st.integers(1, 8), min_size=1), data=st.data())
def test_a_framed_write_is_what_a_read_of_it_frames(
    frames: list[bytes], steps: list[int], data: st.DataObject
) -> None:
    stream = b"".join(frames)
    sinks = {vb: _Sink(vb) for vb in VBUCKETS}
    encoders = {vb: BatchEncoder(DCP, 0x1234 + vb, vb) for vb in VBUCKETS}
    for vb, sink in sinks.items():
        sink.buffer.frame_for(encoders[vb])
    machine = TapConsumerMachine("test", dialed=True)
    offset = n = 0
    while offset < len(stream):
        touched: dict[int, _Sink] = {}
        offset, taken = log_buffer(stream, offset, sinks, NOW, touched, [], steps[n % len(steps)])
        n += 1
        if not taken:
            end = frame_end(stream, offset, True)
            if end is None or not _event_path(sinks, machine, stream[offset:end]):
                break
            offset = end
        for vb in data.draw(st.sets(st.sampled_from(VBUCKETS))):
            _write_and_check(sinks[vb].buffer, encoders[vb])
    for vb in VBUCKETS:
        _write_and_check(sinks[vb].buffer, encoders[vb])


def _write_and_check(buffer: WriteBuffer, encoder: BatchEncoder) -> None:
    """What ``VbLog.write`` does with the buffer, and the check of its framing."""
    if not buffer.data:
        return
    buffer.close_block()
    framed = buffer.framed()
    event("framed" if framed is not None else "not framed")
    if framed is not None:
        assert framed == _walked(encoder, bytes(buffer.data), buffer.first, buffer.high)
    buffer.clear()
    buffer.realign(0)


def test_a_write_of_items_alone_is_framed() -> None:
    """Backfill items with a repeated key: framed, and cut where a read cuts it."""
    sink = _Sink(5)
    encoder = BatchEncoder(DCP, 77, 5)
    sink.buffer.frame_for(encoder)
    machine = TapConsumerMachine("test", dialed=True)
    assert _event_path({5: sink}, machine, encode(TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, 5)))
    keys = [b"a", b"b", b"a", b"c", b"c", b"d"]
    stream = b"".join(
        encode(TapMutation(key, b"v%d" % n, vbucket=5, cas=n + 1, rev_seqno=1, nru=0))
        for n, key in enumerate(keys)
    )
    offset, taken = log_buffer(stream, 0, {5: sink}, NOW, {}, [])
    assert (offset, taken) == (len(stream), len(keys))
    buffer = sink.buffer
    buffer.close_block()
    framed = buffer.framed()
    assert framed is not None
    assert framed[1:4] == (3, 6, 6)  # snapshots cut before the second "a" and "c"
    assert framed == _walked(encoder, bytes(buffer.data), 1, 6)


def test_the_following_stream_takes_the_framed_write_from_the_tail(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path, 3, tail_bytes=1 << 20)
    vblog.open()
    ours = BatchEncoder(DCP, 9, 3)
    other = BatchEncoder(DCP, 9, 3)  # the same settings, another stream: walks the records
    vblog.read_memory(0, 0, BatchCut(ours, 0, 0, 1024, -1))  # it follows the log
    vblog.translator.in_backfill = True
    frames = [
        encode(TapMutation(b"k%d" % (n % 7), b"x" * n, vbucket=3, cas=n + 1, rev_seqno=1, nru=0))
        for n in range(40)
    ]
    for start in (0, 20):
        assert log_buffer(b"".join(frames[start : start + 20]), 0, {3: vblog}, NOW, {}, [])[1] == 20
        vblog.write_early()
    assert len(vblog.tail.framed) == 2
    for after in (0, 20):  # a write at a time: what a read up to its last item frames
        cut, walked = BatchCut(ours, after, 40, 1024, 10**6), BatchCut(other, after, after + 20,
                                                                        1024, 10**6)  # fmt: skip
        vblog.read_memory(after, 40, cut)
        vblog.tail.read(after, after + 20, walked)
        assert cut.finish() == walked.finish()
        assert cut.left == walked.left
    assert not vblog.tail.framed  # both taken
    vblog.close()
