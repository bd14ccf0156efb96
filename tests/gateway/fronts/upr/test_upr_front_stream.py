"""The UPR front against the reference node: full streams, snapshots, resume, rollback."""

from __future__ import annotations

from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Status
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    filled_store,
    final_state,
    store_state,
    write_load,
)
from tests.support.fronts import upr_front_over_node
from tests.support.upr_client import StreamLog, check_snapshots


async def test_full_stream_equals_the_node_under_concurrent_load(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store, node={"checkpoint_interval": 0.05})
    client = await rig.consumer()
    # Streams open during the backfill, and writes keep coming meanwhile.
    for vb in range(VBUCKETS):
        reply = await client.stream_request(vb, 0, MAX_SEQNO, opaque=100 + vb)
        assert isinstance(reply, upr.StreamRequestOk), reply
        assert reply.failover_log == rig.front.logs.logs[vb].failover.entries
    await write_load(store, 600)
    await rig.catch_up()
    # Everything logged is sent before the streams are closed: CLOSE_STREAM
    # ends a stream where it is, and its response is the end.
    streams = rig.front.connections["consumer"].streams
    logs = {100 + vb: StreamLog() for vb in range(VBUCKETS)}
    while any(s.position < rig.front.logs.logs[vb].high_seqno for vb, s in streams.items()):
        event = await client.receive()
        if getattr(event, "opaque", None) in logs and not event.IS_RESPONSE:
            logs[event.opaque].events.append(event)
    for vb in range(VBUCKETS):
        assert (await client.request(upr.CloseStream(opaque=9, vbucket=vb))).status == 0
        log = client.take_pending(100 + vb, logs[100 + vb])
        assert log.end is None  # the close response is the end (upr-producer.cc closeStream)
        check_snapshots(log)
        assert final_state(log) == store_state(store, vb)
        assert log.markers[0].flags & upr.SnapshotFlags.DISK
        assert any(m.flags & upr.SnapshotFlags.CHECKPOINT for m in log.markers)
    assert rig.front.ingest.connections == 1
    await client.aclose()


async def test_end_seqno_and_resume_mid_snapshot_without_rollback(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    vblog = rig.front.logs.logs[1]
    high, uuid = vblog.high_seqno, vblog.failover.uuid
    client = await rig.consumer()
    reply = await client.stream_request(1, 0, high, opaque=1)
    assert isinstance(reply, upr.StreamRequestOk)
    whole = await client.read_stream(1)
    assert whole.end is not None and whole.end.reason == upr.StreamEndReason.OK
    assert whole.items[-1].by_seqno == high
    # Stop in the middle of the first snapshot, then resume with its range.
    marker = whole.markers[0]
    middle = whole.items[5].by_seqno
    reply = await client.stream_request(1, 0, middle, opaque=2)
    part = await client.read_stream(2)
    assert part.items[-1].by_seqno == middle and part.end.reason == upr.StreamEndReason.OK  # type: ignore[union-attr]
    reply = await client.stream_request(
        1, middle, high, uuid=uuid, snap=(marker.start_seqno, marker.end_seqno), opaque=3
    )
    assert isinstance(reply, upr.StreamRequestOk), reply
    rest = await client.read_stream(3)
    assert [e.by_seqno for e in part.items + rest.items] == [e.by_seqno for e in whole.items]
    check_snapshots(rest)
    await client.aclose()


async def test_unknown_uuid_rolls_back_to_zero_and_bad_requests_are_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    client = await rig.consumer()
    reply = await client.stream_request(0, 5, MAX_SEQNO, uuid=12345, snap=(5, 5))
    assert reply == upr.StreamRequestRollback(0, reply.opaque)
    assert rig.front.stats.rollbacks_total["upr_front"] == 1
    reply = await client.stream_request(0, 10, 5)
    assert reply.status == Status.RANGE_ERROR
    reply = await client.stream_request(
        0, 10, 20, uuid=rig.front.logs.logs[0].failover.uuid, snap=(11, 12)
    )
    assert reply.status == Status.RANGE_ERROR
    reply = await client.stream_request(99, 0, MAX_SEQNO)
    assert reply.status == Status.NOT_MY_VBUCKET
    ok = await client.stream_request(2, 0, MAX_SEQNO)
    assert isinstance(ok, upr.StreamRequestOk)
    again = await client.stream_request(2, 0, MAX_SEQNO)
    assert again.status == Status.KEY_EXISTS
    assert (await client.control("no_such_key", "1")).status == Status.INVALID_ARGUMENTS
    flog = await client.failover_log(2)
    assert isinstance(flog, upr.FailoverLogResponse)
    assert flog.failover_log == rig.front.logs.logs[2].failover.entries
    # A malformed packet: INVALID_ARGUMENTS, then the connection closes.
    await client.send_raw(
        b"\x80\x53\x00\x00\x02\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00\x07"
        + b"\x00" * 8
        + b"\x00\x00"
    )
    got = await client.receive()
    while not (got.IS_RESPONSE and got.opaque == 7):
        got = await client.receive()
    assert got.status == Status.INVALID_ARGUMENTS
    assert await client.closed_by_server()
    assert rig.front.stats.protocol_errors_total[("upr_front", "malformed")] == 1
    # Others are untouched.
    other = await rig.consumer(b"other")
    assert isinstance(await other.stream_request(2, 0, MAX_SEQNO), upr.StreamRequestOk)
    await other.aclose()
