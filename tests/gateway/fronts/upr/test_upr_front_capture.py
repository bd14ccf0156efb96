"""Captures of the UPR front: what the ingest received over TAP, what each consumer was sent."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from adapters import upr
from gateway.tools.capture import CaptureRecord, Kind, digest, read_capture
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    caught_up,
    filled_store,
    open_producer,
    start_front,
    start_node,
    until,
    write_load,
)


def segments(directory: Path) -> list[tuple[dict[str, object], list[CaptureRecord]]]:
    out = []
    for _, segment in read_capture(directory):
        assert segment.torn is None
        out.append((segment.meta, segment.typed()))
    return out


def records_of(directory: Path, side: str, connection: str) -> list[CaptureRecord]:
    return [
        r
        for meta, records in segments(directory)
        if meta["side"] == side and meta["connection"] == connection
        for r in records
    ]


def as_sent(event: upr.UprEvent) -> tuple[object, ...]:
    """The fields a capture keeps of a stream message (arrival aside)."""
    if isinstance(event, upr.Mutation):
        return (Kind.MUTATION, event.vbucket, event.key, event.by_seqno, event.rev_seqno,
                event.cas, event.flags, event.expiration, digest(event.value))  # fmt: skip
    if isinstance(event, upr.Deletion | upr.Expiration):
        kind = Kind.EXPIRATION if isinstance(event, upr.Expiration) else Kind.DELETE
        return (kind, event.vbucket, event.key, event.by_seqno, event.rev_seqno, event.cas,
                0, 0, None)  # fmt: skip
    if isinstance(event, upr.SnapshotMarker):
        return (Kind.SNAPSHOT, event.vbucket, event.start_seqno, event.end_seqno, int(event.flags))
    assert isinstance(event, upr.StreamEnd), event
    return (Kind.STREAM_END, event.vbucket, int(event.reason))


def as_recorded(r: CaptureRecord) -> tuple[object, ...]:
    kind = Kind(r.kind)
    if kind.is_item:
        return (kind, r.vbucket, r.key, r.by_seqno, r.rev_seqno, r.cas, r.flags, r.expiration,
                r.digest)  # fmt: skip
    if kind is Kind.SNAPSHOT:
        return (kind, r.vbucket, r.snap_start, r.snap_end, r.marker_flags)
    return (kind, r.vbucket, r.marker_flags)


async def test_captures_hold_what_was_received_and_exactly_what_was_sent(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    _, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    captures = tmp_path / "captures"
    front, port, scope = await start_front(
        nursery, tmp_path / "state", node_port, capture_dir=captures
    )
    with trio.fail_after(10):
        await until(lambda: caught_up(front, store))  # the backfill is logged
    await write_load(store, 300)  # live items, in TAP checkpoints, after the backfill
    with trio.fail_after(10):
        await until(lambda: caught_up(front, store))
    client = await open_producer(port, b"reader")
    received: list[upr.UprEvent] = []
    for vb in range(VBUCKETS):
        high = front.logs.logs[vb].high_seqno
        reply = await client.stream_request(vb, 0, high, opaque=100 + vb)
        assert isinstance(reply, upr.StreamRequestOk), reply
        log = await client.read_stream(100 + vb)
        assert log.end is not None and log.end.reason == upr.StreamEndReason.OK
        received += log.events
    await client.aclose()
    with trio.fail_after(10):
        await until(lambda: not front.connections)
    await scope.stop()  # the gateway stops: every recorder flushes and closes its segment

    metas = [meta for meta, _ in segments(captures)]
    assert {(m["side"], m["connection"], m["direction"]) for m in metas} == {
        ("tap", "upr-front", "received"),
        ("upr", "reader", "sent"),
    }
    # Sent: record for record what the consumer received, in order.
    sent = records_of(captures, "upr", "reader")
    assert [as_recorded(r) for r in sent] == [as_sent(e) for e in received]
    by_snapshot = [r for r in sent if Kind(r.kind).is_item]
    assert all(r.snap_start <= r.by_seqno <= r.snap_end for r in by_snapshot)  # type: ignore[operator]
    # Received: the TAP side saw every version the node holds (a key may
    # come more than once, the last arrival is the node's final state).
    tap = records_of(captures, "tap", "upr-front")
    final: dict[tuple[int, bytes], CaptureRecord] = {}
    for r in tap:
        if Kind(r.kind).is_item:
            assert r.by_seqno is None
            final[(r.vbucket, r.key)] = r
    expected = {(vb, it.key): it for vb in range(VBUCKETS) for it in store.items_since(vb, 0)}
    assert set(final) == set(expected)
    for where, item in expected.items():
        record = final[where]
        assert record.cas == item.cas
        assert (Kind(record.kind) is Kind.DELETE) == item.deleted
        if not item.deleted:
            assert record.digest == digest(item.value)
    assert any(Kind(r.kind) is Kind.BACKFILL_START for r in tap)
    assert any(Kind(r.kind) is Kind.CHECKPOINT_START for r in tap)
    assert all(r.arrival <= time.time() for r in tap + sent)
