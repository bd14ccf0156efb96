"""The node's UPR producer over loopback: streams, snapshots, resume, rollback, errors."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Status
from adapters.mcbp.frames import encode_frame
from gateway.io.connection import PacketConnection
from gateway.node.items import Item, ItemKind, VBucketState
from gateway.node.store import Store
from tests.support.upr_client import (
    MAX_SEQNO,
    StreamLog,
    UprClient,
    check_snapshots,
    start_node,
    until,
)

VBUCKETS = 4


def filled_store(**kwargs: object) -> Store:
    """Writes, overwrites and deletes in every vbucket."""
    store = Store(VBUCKETS, **kwargs)  # type: ignore[arg-type]
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(40):
            store.set(vb, b"key-%d" % i, b"value-%d-%d" % (vb, i), flags=i, now=now)
        for i in range(0, 40, 3):
            store.set(vb, b"key-%d" % i, b"again-%d" % i, now=now)
        for i in range(0, 40, 7):
            store.delete(vb, b"key-%d" % i, now=now)
    return store


def assert_items_match(log: StreamLog, expected: list[Item]) -> None:
    got = [
        (e.key, e.by_seqno, e.rev_seqno, e.cas, e.NAME, getattr(e, "value", b"")) for e in log.items
    ]
    want = [
        (
            it.key,
            it.by_seqno,
            it.rev_seqno,
            it.cas,
            "MUTATION" if it.kind is ItemKind.MUTATION else "DELETION",
            it.value,
        )
        for it in expected
    ]
    assert got == want


async def producer(port: int, name: bytes = b"test", flags: int = 0) -> UprClient:
    client = await UprClient.connect(port)
    reply = await client.open(name, upr.OpenFlags.PRODUCER | flags)
    assert reply.status == Status.SUCCESS
    return client


async def test_full_stream_of_every_vbucket_equals_the_store(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)
    for vb in range(VBUCKETS):
        high = store.high_seqno(vb)
        reply = await client.stream_request(vb, 0, high, opaque=100 + vb)
        assert isinstance(reply, upr.StreamRequestOk)
        assert reply.failover_log == store.failover_log(vb)
        log = await client.read_stream(100 + vb)
        assert log.end is not None and log.end.reason == upr.StreamEndReason.OK
        check_snapshots(log)
        assert [m.flags for m in log.markers] == [upr.SnapshotFlags.DISK]
        assert log.markers[0].end_seqno == high
        assert_items_match(log, store.items_since(vb, 0))
        assert all(e.vbucket == vb for e in log.events)
    await client.aclose()


async def test_live_items_come_in_memory_snapshots_cut_at_checkpoints(
    nursery: trio.Nursery,
) -> None:
    store = filled_store(checkpoint_items=5)
    _, port = await start_node(nursery, store)
    client = await producer(port)
    reply = await client.stream_request(0, 0, MAX_SEQNO, opaque=7)
    assert isinstance(reply, upr.StreamRequestOk)
    backfill_end = store.high_seqno(0)
    backfilled = store.items_since(0, 0)
    log = StreamLog()
    while not log.items or log.items[-1].by_seqno < backfill_end:
        log.events.append(await client.receive())
    now = time.time()
    for i in range(23):
        store.set(0, b"live-%d" % (i % 17), b"v%d" % i, now=now)
    store.delete(0, b"key-1", now=now)
    live_high = store.high_seqno(0)
    while log.items[-1].by_seqno < live_high:
        log.events.append(await client.receive())
    close = await client.request(upr.CloseStream(opaque=99, vbucket=0))
    assert close.status == Status.SUCCESS
    client.take_pending(7, log)
    assert log.end is None  # the close response is the end (upr-producer.cc closeStream)
    check_snapshots(log)
    assert_items_match(log, backfilled + store.items_since(0, backfill_end))
    starts = {cp.start_seqno for cp in store.checkpoints(0)}
    memory = log.markers[1:]
    assert memory and log.markers[0].flags == upr.SnapshotFlags.DISK
    for before, marker in zip(log.markers, memory, strict=False):
        assert marker.flags & upr.SnapshotFlags.MEMORY
        # Flagged when it is the first read from a checkpoint (whose first
        # items may have been overwritten since): 3.0-era src/upr-stream.cc
        # ``ActiveStream::nextCheckpointItem`` / ``snapshot`` (MARKER_FLAG_CHK),
        # see tests/gateway/fronts/upr/test_marker_checkpoint_flag_conform.py.
        begins = any(before.end_seqno < s <= marker.start_seqno for s in starts)
        assert bool(marker.flags & upr.SnapshotFlags.CHECKPOINT) == begins
        # A memory snapshot never crosses into the next checkpoint.
        assert not any(marker.start_seqno < s <= marker.end_seqno for s in starts)
    assert any(m.flags & upr.SnapshotFlags.CHECKPOINT for m in memory)
    await client.aclose()


async def test_resume_from_a_mid_point_sends_only_newer_items(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)
    middle = store.items_since(1, 0)[10].by_seqno
    reply = await client.stream_request(
        1, middle, store.high_seqno(1), uuid=store.uuid(1), snap=(middle, middle), opaque=3
    )
    assert isinstance(reply, upr.StreamRequestOk)
    log = await client.read_stream(3)
    assert_items_match(log, store.items_since(1, middle))
    assert log.items and all(e.by_seqno > middle for e in log.items)
    await client.aclose()


async def test_rollback_decisions(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)
    old_uuid = store.uuid(2)
    forked_at = store.high_seqno(2)
    store.failover(2)
    now = time.time()
    for i in range(5):
        store.set(2, b"after-%d" % i, b"x", now=now)

    # Unknown history: back to 0.
    reply = await client.stream_request(2, 5, uuid=0xDEAD, snap=(5, 5))
    assert reply == upr.StreamRequestRollback(0, reply.opaque)
    # Old history, but nothing received past the fork: resume as asked.
    reply = await client.stream_request(2, forked_at, uuid=old_uuid, snap=(forked_at, forked_at))
    assert isinstance(reply, upr.StreamRequestOk)
    assert reply.failover_log == store.failover_log(2)
    assert reply.failover_log[1] == (old_uuid, 0)
    await client.request(upr.CloseStream(opaque=client.next_opaque(), vbucket=2))
    client.take_pending(reply.opaque)
    # Old history past the fork: roll back to the snapshot start or the fork.
    snap = (forked_at - 2, forked_at + 3)
    reply = await client.stream_request(2, forked_at + 1, uuid=old_uuid, snap=snap)
    assert reply == upr.StreamRequestRollback(forked_at - 2, reply.opaque)
    snap = (forked_at + 1, forked_at + 3)
    reply = await client.stream_request(2, forked_at + 2, uuid=old_uuid, snap=snap)
    assert reply == upr.StreamRequestRollback(forked_at, reply.opaque)
    # Starting from nothing never rolls back.
    reply = await client.stream_request(2, 0, uuid=0xDEAD, snap=(0, 0), end=0)
    assert isinstance(reply, upr.StreamRequestOk)
    await client.aclose()


async def test_stream_request_errors(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)

    async def status(**kwargs: object) -> int:
        reply = await client.stream_request(**kwargs)  # type: ignore[arg-type]
        assert isinstance(reply, upr.Response), reply
        return reply.status

    assert await status(vbucket=VBUCKETS) == Status.NOT_MY_VBUCKET
    assert await status(vbucket=0, start=10, end=5, snap=(10, 10)) == Status.RANGE_ERROR
    assert await status(vbucket=0, start=10, snap=(11, 12)) == Status.RANGE_ERROR
    assert await status(vbucket=0, start=10, snap=(5, 9)) == Status.RANGE_ERROR
    live = await client.stream_request(0, opaque=50)
    assert isinstance(live, upr.StreamRequestOk)
    assert await status(vbucket=0, opaque=51) == Status.KEY_EXISTS
    missing = await client.request(upr.CloseStream(opaque=52, vbucket=1))
    assert missing.status == Status.KEY_NOT_FOUND
    log = await client.failover_log(1)
    assert log == upr.FailoverLogResponse(store.failover_log(1), log.opaque)
    bad = await client.failover_log(VBUCKETS)
    assert bad.status == Status.NOT_MY_VBUCKET
    await client.aclose()


async def test_control_keys(nursery: trio.Nursery) -> None:
    node, port = await start_node(nursery, filled_store())
    client = await producer(port, b"ctl")
    ok = Status.SUCCESS
    assert (await client.control("connection_buffer_size", "1024\x00")).status == ok
    assert (await client.control("enable_noop", "true")).status == ok
    assert (await client.control("set_noop_interval", "120")).status == ok
    assert (await client.control("enable_expiry_opcode", "false")).status == ok
    for key, value in [
        ("no_such_key", "1"),
        ("connection_buffer_size", "lots"),
        ("set_noop_interval", "-1"),
    ]:
        reply = await client.control(key, value)
        assert reply.status == Status.INVALID_ARGUMENTS
        assert isinstance(reply, upr.Response) and reply.value
    conn = node.upr.get("ctl")
    assert conn.window.buffer_size == 1024 and conn.noop_enabled
    # v3.0.0 upr-producer.cc ``UprProducer::control``: a value other than "true"
    # turns NOOPs off.
    assert (await client.control("enable_noop", "yes")).status == ok
    assert not conn.noop_enabled
    await client.aclose()


async def test_malformed_packet_is_answered_then_closed(nursery: trio.Nursery) -> None:
    _, port = await start_node(nursery, filled_store())
    client = await producer(port)
    # A STREAM_REQ with 10 bytes of extras instead of 48.
    await client.send_raw(encode_frame(0x80, 0x53, opaque=9, extras=b"\x00" * 10))
    reply = await client.receive()
    assert isinstance(reply, upr.Response) and reply.opaque == 9
    assert reply.status == Status.INVALID_ARGUMENTS and b"extras" in reply.value
    assert await client.closed_by_server()
    # The node itself is fine.
    other = await producer(port, b"other")
    assert isinstance(await other.stream_request(0, end=0), upr.StreamRequestOk)
    await other.aclose()
    await client.aclose()


async def test_reopening_a_name_closes_the_older_connection(nursery: trio.Nursery) -> None:
    node, port = await start_node(nursery, filled_store())
    first = await producer(port, b"same")
    assert isinstance(await first.stream_request(0, opaque=1), upr.StreamRequestOk)
    second = await producer(port, b"same")
    assert await first.closed_by_server()
    assert node.upr.get("same") is not None
    assert isinstance(await second.stream_request(0, opaque=1), upr.StreamRequestOk)
    stats = dict(node.upr.stats())
    assert stats["ep_dcp_count"] == "1" and stats["ep_dcp_producer_count"] == "1"
    await first.aclose()
    await second.aclose()


async def test_state_change_ends_streams(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)
    assert isinstance(await client.stream_request(1, opaque=11), upr.StreamRequestOk)
    log = StreamLog()
    while len(log.items) < len(store.items_since(1, 0)):
        log.events.append(await client.receive())
    store.set_state(1, VBucketState.REPLICA, now=time.time())
    await client.read_stream(11, log=log)
    assert log.end == upr.StreamEnd(upr.StreamEndReason.STATE_CHANGED, opaque=11, vbucket=1)
    await client.aclose()


async def test_end_seqno_ends_after_its_snapshot(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    client = await producer(port)
    end = store.items_since(0, 0)[5].by_seqno
    assert isinstance(await client.stream_request(0, 0, end, opaque=4), upr.StreamRequestOk)
    log = await client.read_stream(4)
    assert log.end is not None and log.end.reason == upr.StreamEndReason.OK
    assert_items_match(log, store.items_since(0, 0, end))
    # Already there: the stream ends at once, with nothing in it.
    again = await client.stream_request(0, end, end, uuid=store.uuid(0), snap=(end, end))
    assert isinstance(again, upr.StreamRequestOk)
    assert (await client.read_stream(again.opaque)).events == [
        upr.StreamEnd(upr.StreamEndReason.OK, opaque=again.opaque, vbucket=0)
    ]
    await client.aclose()


async def test_stats_name_streams_the_3_0_way(nursery: trio.Nursery) -> None:
    store = filled_store()
    node, port = await start_node(nursery, store)
    client = await producer(port, b"stats")
    await client.control("connection_buffer_size", "100000")
    assert isinstance(await client.stream_request(2, opaque=21), upr.StreamRequestOk)
    total = len(store.items_since(2, 0))
    log = StreamLog()
    while len(log.items) < total:
        log.events.append(await client.receive())
    await until(lambda: node.upr.get("stats").streams[2].state.value == "in-memory")
    stats = dict(node.upr.stats())
    assert stats["ep_dcp_items_sent"] == str(total)
    assert stats["ep_dcp_items_remaining"] == "0"
    assert stats["eq_dcpq:stats:stream_2_state"] == "in-memory"
    assert stats["eq_dcpq:stats:stream_2_opaque"] == "21"
    assert stats["eq_dcpq:stats:stream_2_last_sent_seqno"] == str(store.high_seqno(2))
    # 3.0's upr-stream.cc addStats counts no markers; the name is the UPR front's too.
    markers = sum(isinstance(event, upr.SnapshotMarker) for event in log.events)
    assert stats["eq_dcpq:stats:stream_2_markers_sent"] == str(markers) != "0"
    assert stats["eq_dcpq:stats:max_buffer_bytes"] == "100000"
    assert stats["eq_uprq:stats:items_sent"] == str(total)
    assert int(stats["eq_dcpq:stats:unacked_bytes"]) == client.unacked
    takeover = node.upr.takeover_stats(2, "stats")
    assert takeover is not None and takeover["estimate"] == "0"
    # The same over the wire, as STAT dcp / upr / vbucket-takeover.
    async with await PacketConnection.connect("127.0.0.1", port) as admin:
        wire = await admin.stats("dcp")
        assert wire["eq_dcpq:stats:stream_2_state"] == "in-memory"
        assert (await admin.stats("upr"))["ep_upr_count"] == "1"
        wire = await admin.stats("vbucket-takeover 2 stats")
        assert wire["status"] == "in-memory" and wire["estimate"] == "0"

    assert node.upr.takeover_stats(1, "stats") is None
    assert node.upr.takeover_stats(2, "nobody") is None
    await client.aclose()


async def test_a_start_below_the_purge_seqno_starts_over(nursery: trio.Nursery) -> None:
    """ep-engine 3.0 src/failover-table.cc ``FailoverTable::needsRollback``: a
    consumer starting (not from 0) below the vbucket's purge seqno may have missed
    a purged tombstone, so it rolls back to 0; at or past it, it resumes."""
    store = filled_store()
    _, port = await start_node(nursery, store)
    uuid = store.uuid(1)
    tombstone = max(
        (it for it in store.items_since(1, 0) if it.kind is not ItemKind.MUTATION),
        key=lambda it: it.by_seqno,
    )
    assert store.purge_tombstones(time.time() + 1, vb=1) > 0
    assert store.purge_seqno(1) == tombstone.by_seqno
    client = await producer(port)
    async with await PacketConnection.connect("127.0.0.1", port) as admin:
        seqnos = await admin.stats("vbucket-seqno 1")
    assert seqnos["vb_1:purge_seqno"] == str(tombstone.by_seqno)

    below = tombstone.by_seqno - 1
    reply = await client.stream_request(1, below, uuid=uuid, snap=(below, below))
    assert reply == upr.StreamRequestRollback(0, reply.opaque)
    # At the purge seqno nothing purged is missing: resume as asked.
    at = tombstone.by_seqno
    reply = await client.stream_request(1, at, uuid=uuid, snap=(at, at), end=at)
    assert isinstance(reply, upr.StreamRequestOk)
    # From 0 a consumer has nothing to lose, whatever was purged.
    reply = await client.stream_request(1, 0, uuid=0, snap=(0, 0), end=0)
    assert isinstance(reply, upr.StreamRequestOk)
    # Other vbuckets purged nothing.
    assert store.purge_seqno(0) == 0


def test_the_purge_seqno_survives_a_restart(tmp_path: Path) -> None:
    store = Store(VBUCKETS, data_dir=tmp_path)
    now = time.time()
    for i in range(10):
        store.set(3, b"k-%d" % i, b"v", now=now)
    for i in range(0, 10, 2):
        store.delete(3, b"k-%d" % i, now=now)
    store.purge_tombstones(now + 1)
    purged = store.purge_seqno(3)
    assert purged > 0
    store.close()
    reopened = Store(VBUCKETS, data_dir=tmp_path)
    assert reopened.purge_seqno(3) == purged
    reopened.close()
