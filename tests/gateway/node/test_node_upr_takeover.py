"""Takeover streams of the node's UPR producer, and the upr-draft dialect end to end."""

from __future__ import annotations

import time

import trio
import trio.testing

from adapters import upr
from gateway.node.items import VBucketState
from gateway.node.store import Store
from tests.support.upr_client import StreamLog, UprClient, start_node

SF = upr.SnapshotFlags


def store_with_items(vbuckets: int = 2, count: int = 30) -> Store:
    store = Store(vbuckets)
    now = time.time()
    for vb in range(vbuckets):
        for i in range(count):
            store.set(vb, b"k%d" % i, b"value %d" % i, now=now)
        store.delete(vb, b"k3", now=now)
    return store


def latest(log: StreamLog) -> dict[bytes, tuple[str, int]]:
    """Per key, the last message about it: what a consumer would hold."""
    return {e.key: (e.NAME, e.by_seqno) for e in log.items}


def stored(store: Store, vb: int) -> dict[bytes, tuple[str, int]]:
    return {
        it.key: ("DELETION" if it.deleted else "MUTATION", it.by_seqno)
        for it in store.items_since(vb, 0)
    }


async def test_takeover_hands_over_and_kills_the_vbucket(nursery: trio.Nursery) -> None:
    store = store_with_items()
    node, port = await start_node(nursery, store, vbuckets=2)
    client = await UprClient.connect(port)
    await client.open(b"takeover")
    watcher = await UprClient.connect(port)
    await watcher.open(b"watcher")
    assert isinstance(await watcher.stream_request(0, opaque=1), upr.StreamRequestOk)
    reply = await client.stream_request(0, flags=upr.StreamFlags.TAKEOVER, opaque=8)
    assert isinstance(reply, upr.StreamRequestOk)

    log = StreamLog()
    while not isinstance(event := await client.receive(), upr.SetVbucketState):
        log.events.append(event)
    assert event == upr.SetVbucketState(VBucketState.PENDING, opaque=8, vbucket=0)
    log.events.append(event)
    # Until we answer, the source stays active and takes writes.
    await trio.testing.wait_all_tasks_blocked()
    assert store.state(0) is VBucketState.ACTIVE
    assert node.upr.takeover_stats(0, "takeover")["status"] == "takeover-wait"
    store.set(0, b"late", b"written while pending", now=time.time())
    await client.answer(event)

    # The late write follows in a snapshot that wants an ack, before ACTIVE.
    while not isinstance(event := await client.receive(), upr.SnapshotMarker):
        log.events.append(event)
    log.events.append(event)
    assert event.flags == SF.MEMORY | SF.ACK
    late = await client.receive()
    assert isinstance(late, upr.Mutation) and late.key == b"late"
    log.events.append(late)
    await trio.testing.wait_all_tasks_blocked()
    assert store.state(0) is VBucketState.DEAD
    assert node.upr.takeover_stats(0, "takeover")["status"] == "takeover-send"
    await client.answer(event)

    await client.read_stream(8, log=log)
    assert log.states() == [VBucketState.PENDING, VBucketState.ACTIVE]
    assert log.end == upr.StreamEnd(upr.StreamEndReason.OK, opaque=8, vbucket=0)
    assert log.markers[0].flags == SF.DISK
    assert latest(log) == stored(store, 0)
    assert store.state(0) is VBucketState.DEAD
    # The hand-off ends no other stream of the vbucket (3.0 src/upr-stream.cc
    # ``setVBucketStateAckRecieved`` makes it dead with ``notify_upr`` false):
    # the watcher gets everything, the late write too, then a later state
    # change (src/ep.cc ``setVBucketState``, notified) ends it.
    other = StreamLog()
    while latest(other) != stored(store, 0):
        other.events.append(await watcher.receive())
    assert other.end is None
    store.set_state(0, VBucketState.REPLICA, now=time.time())
    await watcher.read_stream(1, log=other)
    assert other.end == upr.StreamEnd(upr.StreamEndReason.STATE_CHANGED, opaque=1, vbucket=0)
    await client.aclose()
    await watcher.aclose()


async def test_takeover_of_a_dead_vbucket_hands_it_over_as_it_is(nursery: trio.Nursery) -> None:
    """ep-engine 3.0.0 src/upr-producer.cc ``UprProducer::streamRequest`` (hisundar/ep-engine
    c8c42ea) checks no vbucket state, and src/upr-stream.cc ``setVBucketStateAckRecieved``
    makes the vbucket dead again (``setVBucketState`` of the same state does nothing):
    a dead vbucket is streamed and handed over as it is, PENDING then ACTIVE, ending OK."""
    store = store_with_items()
    store.set_state(1, VBucketState.DEAD, now=time.time())
    _, port = await start_node(nursery, store, vbuckets=2)
    client = await UprClient.connect(port)
    await client.open(b"late")
    reply = await client.stream_request(1, flags=upr.StreamFlags.TAKEOVER, opaque=8)
    assert isinstance(reply, upr.StreamRequestOk)
    with trio.fail_after(20):
        log = await client.read_stream(8)  # answering each SET_VBUCKET_STATE
    assert log.states() == [VBucketState.PENDING, VBucketState.ACTIVE]
    assert log.end == upr.StreamEnd(upr.StreamEndReason.OK, opaque=8, vbucket=1)
    assert latest(log) == stored(store, 1)
    assert store.state(1) is VBucketState.DEAD
    await client.aclose()


# -- the transport draft ---------------------------------------------------------


def check_draft_snapshots(log: StreamLog) -> None:
    """STREAM_START first; items only between SNAPSHOT_START and SNAPSHOT_END."""
    assert isinstance(log.events[0], upr.StreamStart)
    inside = False
    for event in log.events[1:-1]:
        if isinstance(event, upr.SnapshotStart):
            assert not inside
            inside = True
        elif isinstance(event, upr.SnapshotEnd):
            assert inside
            inside = False
        elif isinstance(event, upr.Mutation | upr.Deletion):
            assert inside
    assert not inside


async def test_upr_draft_dialect_end_to_end(nursery: trio.Nursery) -> None:
    store = store_with_items()
    node, port = await start_node(nursery, store, vbuckets=2, dialect="upr-draft")
    client = await UprClient.connect(port, upr.UPR_DRAFT)
    # No OPEN in the draft: the first request opens the connection.
    log_reply = await client.failover_log(0)
    assert log_reply == upr.FailoverLogResponse(store.failover_log(0), log_reply.opaque)
    high = store.high_seqno(0)
    reply = await client.stream_request(0, 0, high, opaque=5)
    assert reply == upr.StreamRequestOk(store.failover_log(0), 5)
    log = await client.read_stream(5)
    check_draft_snapshots(log)
    assert log.end == upr.StreamEnd(upr.StreamEndReason.OK, opaque=5, vbucket=0)
    assert latest(log) == stored(store, 0)
    assert [e.NAME for e in log.items].count("DELETION") == 1

    # Rollback: the draft carries the seqno in the extras.
    rollback = await client.stream_request(0, 7, uuid=0xBAD, opaque=6)
    assert rollback == upr.StreamRequestRollback(0, 6)

    # Takeover: states in the draft's numbering, no replies awaited.
    reply = await client.stream_request(1, flags=upr.StreamFlags.TAKEOVER, opaque=9)
    assert isinstance(reply, upr.StreamRequestOk)
    log = await client.read_stream(9)
    check_draft_snapshots(log)
    assert log.states() == [VBucketState.PENDING, VBucketState.ACTIVE]
    pending = next(f for f in log.frames if f.opcode == 0x5A)
    assert pending.extras == b"\x02"  # pending is 2 in the draft
    assert log.end == upr.StreamEnd(upr.StreamEndReason.OK, opaque=9, vbucket=1)
    assert latest(log) == stored(store, 1)
    assert store.state(1) is VBucketState.DEAD
    # Nameless in the draft: the connection goes by its peer's address.
    [conn] = node.upr.connections()
    assert conn.kind == "producer" and "127.0.0.1" in conn.name
    await client.aclose()
