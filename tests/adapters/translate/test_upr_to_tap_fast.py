"""The TAP front's fast path sends byte for byte what the event path sends.

The event path (``UprToTap.feed``, ``TapProducer.stamp``, the TAP codec) is
the reference: for any generated UPR stream of a few vbuckets, cut into
socket reads at any byte (mid-frame included), the fast path
(``item_from_frame``, else ``UprToTap.advance`` and ``stamped_item``) and
the buffer path the TAP front runs over whole socket reads
(``translate_items``, ``marker_frame``, ``close_frame``, the event path for
the rest), and the same with ``translate_items`` taking markers and closes
inline, must produce the same TAP bytes per read, ask for acks on the same
messages, and keep a retransmit window that encodes to the same bytes; with
and without checkpoint sync (the CHECKPOINT flag: CHECKPOINT_START/END only
with it, ep-engine 2.5.1 src/tapconnection.cc ``supportCheckpointSync_``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.mcbp import Frame, FrameReader, Status
from adapters.tap import TapFlags, TapOpcode, TapResponse, decode_frame, encode
from adapters.tap.producer import TapProducer
from adapters.translate.upr_to_tap import UprToTap
from adapters.translate.upr_to_tap_fast import (
    FAST_OPCODES,
    close_frame,
    item_from_frame,
    marker_frame,
    snapshot_marker,
    stamped_item,
    translate_items,
)
from adapters.upr import SnapshotFlags

ITEMS = (upr.Mutation, upr.Deletion, upr.Expiration)
VBUCKETS = (0, 5, 1023)


@dataclass
class Path:
    """One TAP stream's producer and per-vbucket translators, as a session holds them."""

    translators: dict[int, UprToTap]
    producer: TapProducer
    support_ack: bool
    buffer: bytearray = field(default_factory=bytearray)
    offset: int = 0

    @classmethod
    def make(cls, options: dict[str, bool | int]) -> Path:
        translators = {
            vb: UprToTap(
                vb,
                backfill=bool(options["backfill"]),
                keys_only=bool(options["keys_only"]),
                network_byte_order=bool(options["network_order"]),
                checkpoint_sync=bool(options["checkpoint_sync"]),
            )
            for vb in VBUCKETS
        }
        producer = TapProducer(
            support_ack=bool(options["support_ack"]),
            ack_interval=int(options["ack_interval"]),
            max_unacked=1 << 30,
        )
        return cls(translators, producer, bool(options["support_ack"]))

    def read(self, data: bytes, reader: FrameReader, fast: bool) -> bytes:
        """Every TAP frame one socket read of ``data`` leads to, the last asking for an ack."""
        reader.receive_data(data)
        batch: list[bytes] = []
        while (frame := reader.next_frame()) is not None:
            event = upr.decode_frame(frame)
            translator = self.translators[frame.vbucket_or_status]
            if fast and frame.is_request and frame.opcode in FAST_OPCODES:
                done = item_from_frame(frame, translator, self.producer)
                if done is not None:
                    data, _, closes = done
                    batch.append(data)
                    closing = translator.close() if closes else []
                    batch.extend(encode(self.producer.stamp(message)) for message in closing)
                    continue
            if fast and type(event) in ITEMS:
                closes = translator.advance(event.by_seqno)  # type: ignore[union-attr]
                batch.append(stamped_item(event, translator, self.producer))  # type: ignore[arg-type]
                closing = translator.close() if closes else []
            else:
                closing = translator.feed(event)
            batch.extend(encode(self.producer.stamp(message)) for message in closing)
        if batch and self.support_ack:
            batch[-1] = encode(self.producer.request_ack_on_last())
        return b"".join(batch)

    def read_buffer(self, data: bytes, *, live: bool = False) -> bytes:
        """``read`` as the TAP front runs it: from the read buffer, runs of items and
        plain markers as bytes, anything else as events; ``live``: runs that take
        markers and closes too, as the session's ``_fast_items`` asks for them."""
        if self.offset:
            del self.buffer[: self.offset]
            self.offset = 0
        self.buffer += data
        streams = {opaque_of(vb): translator for vb, translator in self.translators.items()}
        batch: list[bytes] = []
        while True:
            touched: dict[int, UprToTap] = {}
            closed: list[int] | None = [] if live else None
            self.offset, credit, *_, closing = translate_items(
                self.buffer, self.offset, streams, self.producer, batch, touched, closed
            )
            assert bool(credit) == bool(touched)
            for at in range(0, len(closed or ()), 3):
                vbucket, checkpoint_id, seqno = closed[at : at + 3]  # type: ignore[index]
                assert self.translators[vbucket].checkpoints[checkpoint_id][1] == seqno
            if closing is not None:
                closed = close_frame(closing, self.producer)
                if closed is not None:
                    batch.append(closed[0])
                continue
            marker = snapshot_marker(self.buffer, self.offset)
            if marker is not None and not marker[3] & SnapshotFlags.ACK:
                opaque, start, end, flags = marker
                done = marker_frame(streams[opaque], self.producer, start, end, flags)
                if done is not None:
                    if done:  # (empty: the snapshot opens unsaid, no checkpoint sync)
                        batch.append(done)
                    self.offset += 44
                    continue
            reader = FrameReader()
            reader.receive_data(self.buffer[self.offset :])
            frame = reader.next_frame()
            if frame is None:
                break
            self.offset += frame.size
            event = upr.decode_frame(frame)
            translator = self.translators[frame.vbucket_or_status]
            if type(event) in ITEMS:
                closes = translator.advance(event.by_seqno)  # type: ignore[union-attr]
                batch.append(stamped_item(event, translator, self.producer))  # type: ignore[arg-type]
                closing_messages = translator.close() if closes else []
            else:
                closing_messages = translator.feed(event)
            batch.extend(encode(self.producer.stamp(message)) for message in closing_messages)
        if batch and self.support_ack:
            batch[-1] = self.producer.ack_request_on_last()
        return b"".join(batch)


def opaque_of(vbucket: int) -> int:
    """Each vbucket's stream answers to its own opaque, as upstream streams do."""
    return 100 + vbucket


keys = st.binary(min_size=1, max_size=12)


@st.composite
def streams(draw: st.DrawFn) -> list[upr.UprEvent]:
    """Interleaved vbucket streams: snapshots of items, state changes and ends."""
    last = dict.fromkeys(VBUCKETS, 0)
    events: list[upr.UprEvent] = []
    for _ in range(draw(st.integers(0, 12))):
        vb = draw(st.sampled_from(VBUCKETS))
        kind = draw(st.sampled_from(["snapshot", "snapshot", "snapshot", "state", "end"]))
        if kind == "state":
            state = draw(st.sampled_from(list(upr.VBucketState)))
            events.append(upr.SetVbucketState(state, vbucket=vb))
            continue
        if kind == "end":
            events.append(upr.StreamEnd(upr.StreamEndReason.OK, vbucket=vb))
            continue
        count = draw(st.integers(0, 6))
        short = draw(st.integers(0, 2))  # deduplication leaves a snapshot short
        flags = draw(st.sampled_from([SnapshotFlags.DISK, SnapshotFlags.MEMORY]))
        if draw(st.booleans()):
            flags |= SnapshotFlags.ACK
        start = last[vb] + 1
        events.append(upr.SnapshotMarker(start, start + count + short, flags, vbucket=vb))
        for seqno in range(start, start + count):
            item = draw(st.sampled_from(ITEMS))
            common = {
                "key": draw(keys),
                "by_seqno": seqno,
                "rev_seqno": draw(st.integers(0, 2**64 - 1)),
                "cas": draw(st.integers(0, 2**64 - 1)),
                "vbucket": vb,
            }
            if item is upr.Mutation:
                events.append(
                    upr.Mutation(
                        value=draw(st.binary(max_size=20)),
                        flags=draw(st.integers(0, 2**32 - 1)),
                        expiration=draw(st.integers(0, 2**32 - 1)),
                        lock_time=draw(st.integers(0, 2**32 - 1)),
                        nru=draw(st.integers(0, 255)),
                        datatype=draw(st.integers(0, 255)),
                        meta=draw(st.binary(max_size=3)),
                        **common,
                    )
                )
            else:
                # A delete time takes the newer layout: the event path's alone.
                delete_time = draw(st.none() | st.integers(0, 2**32 - 1))
                meta = draw(st.binary(max_size=3)) if delete_time is None else b""
                events.append(item(delete_time=delete_time, meta=meta, **common))
        last[vb] = start + count - 1
    return events


options = st.fixed_dictionaries(
    {
        "backfill": st.booleans(),
        "keys_only": st.booleans(),
        "network_order": st.booleans(),
        "checkpoint_sync": st.booleans(),
        "support_ack": st.booleans(),
        "ack_interval": st.integers(1, 4),
    }
)


def resent(producer: TapProducer) -> list[bytes]:
    """What the producer sends again after a busy nack and its backoff."""
    producer.receive(TapResponse(TapOpcode.MUTATION, status=Status.BUSY), now=0.0)
    return [encode(message) for message in producer.retransmit_due(now=1e9)]


def one_frame(data: bytes) -> Frame:
    reader = FrameReader()
    reader.receive_data(data)
    frame = reader.next_frame()
    assert frame is not None and reader.buffered == 0
    return frame


def cut(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in pairwise(edges)]


@settings(max_examples=300, deadline=None)
@given(streams(), options, st.lists(st.integers(0, 1 << 16), max_size=8))
def test_fast_path_sends_what_the_event_path_sends(
    events: list[upr.UprEvent], opts: dict[str, bool | int], points: list[int]
) -> None:
    wire = b"".join(
        upr.encode(replace(event, opaque=opaque_of(event.vbucket)))  # type: ignore[union-attr]
        for event in events
    )
    slow, fast, whole, live = (Path.make(opts) for _ in range(4))
    slow_reader, fast_reader = FrameReader(), FrameReader()
    for chunk in cut(wire, points):
        expected = slow.read(chunk, slow_reader, False)
        assert fast.read(chunk, fast_reader, True) == expected
        assert whole.read_buffer(chunk) == expected
        assert live.read_buffer(chunk, live=True) == expected
    # The retransmit window re-encodes to the same bytes, and the positions agree.
    assert resent(fast.producer) == resent(slow.producer) == resent(whole.producer)
    assert resent(live.producer) == resent(slow.producer)
    for vb in VBUCKETS:
        b = slow.translators[vb]
        for other in (fast, whole, live):
            a = other.translators[vb]
            assert (a.last_seqno, a.open, a.checkpoints) == (b.last_seqno, b.open, b.checkpoints)
            assert (a.snap_start, a.snap_end, a.items_in_snap) == (
                b.snap_start,
                b.snap_end,
                b.items_in_snap,
            )


def test_a_kept_frame_is_restamped_for_an_ack_request() -> None:
    """``request_ack_on_last`` on a fast-path frame writes the ACK flag into it."""
    producer = TapProducer(support_ack=True, ack_interval=100)
    translator = UprToTap(7, backfill=False)
    translator.feed(upr.SnapshotMarker(1, 1, SnapshotFlags.MEMORY, vbucket=7))
    translator.advance(1)
    item = upr.Mutation(b"key", b"value", by_seqno=1, rev_seqno=2, cas=3, vbucket=7)
    sent = decode_frame(one_frame(stamped_item(item, translator, producer)))
    assert not sent.tap_flags & TapFlags.ACK  # type: ignore[union-attr]
    asked = encode(producer.request_ack_on_last())
    again = decode_frame(one_frame(asked))
    assert again.tap_flags & TapFlags.ACK  # type: ignore[union-attr]
    assert (again.key, again.opaque, again.vbucket) == (b"key", sent.opaque, 7)  # type: ignore[union-attr]


def test_without_checkpoint_sync_a_live_run_sends_the_items_alone() -> None:
    """One-item snapshots to a client without the CHECKPOINT flag: the run takes the
    markers and closes inline and sends only the items, stamped with consecutive
    sequence numbers (2.5.1 src/tapconnection.cc: no checkpoint message is queued
    without ``supportCheckpointSync_``, and each message sent takes the next seqno)."""
    producer = TapProducer(support_ack=True, ack_interval=100, max_unacked=1000)
    translator = UprToTap(7, backfill=False)
    wire = b"".join(
        upr.encode(event)
        for seqno in (1, 2, 3)
        for event in (
            upr.SnapshotMarker(seqno, seqno, SnapshotFlags.MEMORY, vbucket=7, opaque=9),
            upr.Mutation(b"k%d" % seqno, b"v", by_seqno=seqno, vbucket=7, opaque=9),
        )
    )
    out: list[bytes] = []
    closed: list[int] = []
    offset, _, mutations, _, markers, closing = translate_items(
        wire, 0, {9: translator}, producer, out, {}, closed
    )
    assert (offset, mutations, markers, closing, closed) == (len(wire), 3, 0, None, [])
    sent = [decode_frame(one_frame(frame)) for frame in out]
    assert [(m.NAME, m.opaque) for m in sent] == [("MUTATION", 1), ("MUTATION", 2), ("MUTATION", 3)]
    assert translator.open is None and translator.checkpoints == {}
    assert marker_frame(translator, producer, 4, 4, SnapshotFlags.MEMORY) == b""
    assert translator.open is not None and translator.open.checkpoint_id == 0
