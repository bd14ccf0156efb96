"""A connection's caught-up streams served by one task (``LiveServer``).

For any run of publishes over several vbuckets (one item or many, seqno
gaps, keys seen again, TAP checkpoints, deletions and expirations), buffer
acks of any size, flow control on or off, and streams that stop at an end
seqno or fall behind the in-memory tail, what reaches the consumer is, per
stream, the stream's items in seqno order, each once, every one under the
SNAPSHOT_MARKER of the snapshot ``cut_snapshots`` makes of the read it came
in (the bytes ``BatchEncoder`` frames for those items alone); the window is
never exceeded by more than the message that filled it, as a producer stops
only once the buffer is full (ep-engine v3.0.0 src/upr-producer.cc,
``BufferLog``; src/upr-stream.cc, snapshots of the checkpoint's items).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.translate.log_records import ItemKind, LogItem
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from adapters.upr.dialect import DCP
from gateway.fronts.upr.producer import UprConnection
from gateway.fronts.upr.streams import LogStream
from gateway.io.connection import PacketConnection
from gateway.metrics.figures import StreamStats

VBUCKETS = 4
LARGEST_MESSAGE = 24 + 31 + 8 + 40  # header, mutation extras, key, value


class FakeLog:
    """What ``LiveServer`` uses of a ``VbLog``: an in-memory tail above ``floor``."""

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.items: list[LogItem] = []
        self.high_seqno = 0
        self.floor = 0
        self.swapping = False
        self._watchers: list[Callable[[], None]] = []

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        self._watchers.append(wake)
        return lambda: self._watchers.remove(wake)

    def publish(self, items: list[LogItem]) -> None:
        self.items += items
        self.high_seqno = items[-1].by_seqno
        for wake in list(self._watchers):
            wake()

    def in_memory(self, after: int) -> bool:
        return after >= self.high_seqno or after >= self.floor

    def read_memory(self, after: int, upto: int, sink: BatchCut) -> None:
        # As rows (``BatchCut.block`` frames the same bytes: test_serve_from_blocks).
        seqnos = [item.by_seqno for item in self.items]
        for item in self.items[bisect.bisect_right(seqnos, after) :]:
            if sink.item(item) or item.by_seqno > min(upto, self.high_seqno):
                return


_item = st.tuples(
    st.integers(1, 3),  # seqno gap
    st.sampled_from([ItemKind.MUTATION] * 3 + [ItemKind.DELETION, ItemKind.EXPIRATION]),
    st.sampled_from([b"a", b"b", b"key-c", b"d" * 8]),
    st.binary(max_size=40),
    st.booleans(),  # checkpoint start
)
_step = st.one_of(
    st.tuples(
        st.just("publish"), st.integers(0, VBUCKETS - 1), st.lists(_item, min_size=1, max_size=12)
    ),
    st.tuples(st.just("ack"), st.integers(1, 4000)),
    st.tuples(st.just("behind"), st.integers(0, VBUCKETS - 1)),
)


def _frames(data: bytes) -> list[bytes]:
    out, offset = [], 0
    while offset < len(data):
        size = 24 + struct.unpack_from(">I", data, offset + 8)[0]
        out.append(data[offset : offset + size])
        offset += size
    assert offset == len(data)
    return out


async def _serve(steps: list[Any], window: int | None, ends: list[int]) -> None:
    marker_op = DCP.opcodes[upr.Command.SNAPSHOT_MARKER]
    front = SimpleNamespace(
        dialect=DCP,
        config=SimpleNamespace(noop_interval=0.0),
        serves=lambda _vb: True,
        door=SimpleNamespace(answer=None),
    )
    server_side, client_side = trio.testing.memory_stream_pair()
    received = bytearray()
    logs = [FakeLog(vb) for vb in range(VBUCKETS)]
    async with trio.open_nursery() as nursery:
        packets = PacketConnection(server_side, name="consumer")
        packets.start_writer(nursery)
        stats = StreamStats("upr_front", "consumer", "tap")
        producer = UprConnection(front, packets, "consumer", upr.OpenFlags(0), stats)  # type: ignore[arg-type]
        producer._nursery = nursery
        if window is not None:
            producer.window.set_buffer_size(window)

        async def read() -> None:
            while data := await client_side.receive_some():
                received.extend(data)

        nursery.start_soon(read)
        streams = []
        released: dict[int, int] = {}
        for vb, log in enumerate(logs):
            request = upr.StreamRequest(start_seqno=0, end_seqno=ends[vb], opaque=100 + vb,
                                        vbucket=vb)  # fmt: skip
            stream = LogStream(producer, log, request)  # type: ignore[arg-type]
            streams.append(stream)

            async def follow(stream: LogStream = stream) -> None:
                await producer.live.follow(stream)
                released[stream.vbucket] = stream.position

            nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        seqnos = [0] * VBUCKETS
        checkpoints = [1] * VBUCKETS
        for step in steps:
            if step[0] == "publish":
                _, vb, specs = step
                items = []
                for gap, kind, key, value, start in specs:
                    seqnos[vb] += gap
                    checkpoints[vb] += start
                    items.append(LogItem(seqnos[vb], kind, key,
                                         value if kind is ItemKind.MUTATION else b"",
                                         rev_seqno=seqnos[vb], cas=seqnos[vb] * 7,
                                         checkpoint_id=checkpoints[vb],
                                         checkpoint_start=start))  # fmt: skip
                logs[vb].publish(items)
            elif step[0] == "ack":
                if window is not None:
                    producer.window.acknowledged(step[1])
                    producer._on_acknowledged()
                    producer._room.set()
            else:
                log = logs[step[1]]
                log.floor = log.high_seqno  # the tail moved on: reads from before go to disk
            await trio.testing.wait_all_tasks_blocked()
            if window is not None:
                assert producer.window.unacked_bytes < window + LARGEST_MESSAGE + 44
        while window is not None and producer.window.unacked_bytes:
            producer.window.acknowledged(producer.window.unacked_bytes)
            producer._on_acknowledged()
            producer._room.set()
            await trio.testing.wait_all_tasks_blocked()
        assert not producer.live._rest
        packets.finish()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    assert len(received) == producer.window.total_sent == stats.bytes_sent
    assert not producer._in_flight  # all acked (without flow control, none kept)
    counts = stats.items_sent
    assert counts["marker"] == sum(stream.markers_sent for stream in streams)
    assert counts["mutation"] + counts["deletion"] + counts["expiration"] == sum(
        stream.items_sent for stream in streams
    )
    per_vb: dict[int, list[bytes]] = {vb: [] for vb in range(VBUCKETS)}
    for frame in _frames(bytes(received)):
        per_vb[struct.unpack_from(">H", frame, 6)[0]].append(frame)
    for vb, frames in per_vb.items():
        log, stream = logs[vb], streams[vb]
        encoder = BatchEncoder(DCP, 100 + vb, vb)
        by_seqno = {item.by_seqno: item for item in log.items}
        sent: list[int] = []
        at = 0
        while at < len(frames):
            marker = frames[at]
            assert marker[1] == marker_op
            start, end = struct.unpack_from(">QQ", marker, 24)
            snap = [item for item in log.items if start <= item.by_seqno <= end]
            expected = encoder.encode(snap).data
            got = b"".join(frames[at : at + 1 + len(snap)])
            assert got == expected
            sent += [item.by_seqno for item in snap]
            at += 1 + len(snap)
        assert sent == sorted(by_seqno)[: len(sent)]  # in order, each once, no hole
        assert stream.items_sent == len(sent)
        assert stream.markers_sent == sum(1 for f in frames if f[1] == marker_op)
        if sent:
            assert stream.position >= sent[-1]
        limit = min(log.high_seqno, ends[vb])
        whole = [s for s in sorted(by_seqno) if s <= limit]
        if vb in released:
            assert released[vb] >= ends[vb] or not log.in_memory(released[vb])
        else:
            assert sent == whole  # nothing left behind
        assert all(s <= ends[vb] for s in sent)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_step, max_size=30),
    st.one_of(st.none(), st.sampled_from([60, 150, 400]), st.integers(60, 3000)),
    st.lists(st.sampled_from([2**64 - 1, 2**64 - 1, 5, 12]), min_size=VBUCKETS, max_size=VBUCKETS),
)
@example(  # a batch the window cuts, then more of the stream behind it
    [("publish", 0, [(1, ItemKind.MUTATION, b"a", b"x" * 40, False)] * 6)], 60, [2**64 - 1] * 4
)
def test_live_server_sends_each_stream_in_order_within_the_window(
    steps: list[Any], window: int | None, ends: list[int]
) -> None:
    trio.run(_serve, steps, window, ends)
