"""The node's UPR producer: flow control, NOOPs, expirations and deletion layouts."""

from __future__ import annotations

import time

import trio

from adapters import upr
from adapters.mcbp import Status
from gateway.node.items import ItemKind
from gateway.node.store import Store
from tests.support.upr_client import StreamLog, UprClient, check_snapshots, start_node, until

BUFFER = 512
LARGEST_MESSAGE = 24 + 31 + 7 + 90
"""Header, mutation extras, key and the largest value the flow-control test writes."""


async def producer(port: int, name: bytes, flags: int = 0) -> UprClient:
    client = await UprClient.connect(port)
    assert (await client.open(name, upr.OpenFlags.PRODUCER | flags)).status == Status.SUCCESS
    return client


async def test_flow_control_stops_at_the_buffer_and_resumes_on_acks(
    nursery: trio.Nursery,
) -> None:
    store = Store(2, checkpoint_items=7)
    now = time.time()
    for i in range(60):
        store.set(0, b"key-%03d" % i, b"v" * (i * 3 % 90), now=now)
    node, port = await start_node(nursery, store, vbuckets=2)
    client = await producer(port, b"slow")
    assert (await client.control("connection_buffer_size", str(BUFFER))).status == 0
    assert isinstance(
        await client.stream_request(0, 0, store.high_seqno(0), opaque=5), upr.StreamRequestOk
    )
    conn = node.upr.get("slow")
    window, stream = conn.window, conn.streams[0]
    log = StreamLog()
    stalls = acked = 0
    while log.end is None:
        # The producer sends until the window is full, then waits for us.
        await until(lambda: stream.end_reason is not None or not window.can_send)
        if stream.end_reason is None:
            stalls += 1
            assert BUFFER <= window.unacked_bytes < BUFFER + LARGEST_MESSAGE
            assert dict(conn.connection_stats())["paused"] == "true"
            estimate = node.upr.takeover_stats(0, "slow")["estimate"]
            assert int(estimate) == len(store.items_since(0, 0)) - stream.items_sent
        # Everything it sent arrives, and nothing more until we acknowledge.
        while client.unacked < window.unacked_bytes:
            log.events.append(await client.receive())
        assert client.unacked == window.unacked_bytes
        acked += client.unacked
        await client.ack_buffer()
        await until(lambda expected=acked: window.total_acked == expected)
    total = conn.window.total_sent
    assert stalls >= total // (BUFFER + LARGEST_MESSAGE) > 5, (stalls, total)
    assert [e.key for e in log.items] == [it.key for it in store.items_since(0, 0)]
    check_snapshots(log)
    await client.aclose()


async def test_streams_share_the_window_and_all_resume(nursery: trio.Nursery) -> None:
    store = Store(3)
    now = time.time()
    for vb in range(3):
        for i in range(40):
            store.set(vb, b"key-%d" % i, b"x" * 40, now=now)
    node, port = await start_node(nursery, store, vbuckets=3)
    client = await producer(port, b"shared")
    assert (await client.control("connection_buffer_size", str(BUFFER))).status == 0
    for vb in range(3):
        reply = await client.stream_request(vb, 0, store.high_seqno(vb), opaque=vb + 1)
        assert isinstance(reply, upr.StreamRequestOk)
    window = node.upr.get("shared").window
    logs = {vb + 1: StreamLog() for vb in range(3)}
    ended = 0
    while ended < 3:
        event = await client.receive()
        logs[event.opaque].events.append(event)
        ended += isinstance(event, upr.StreamEnd)
        assert window.unacked_bytes < BUFFER + LARGEST_MESSAGE
        if client.unacked >= BUFFER // 2:
            await client.ack_buffer()
    for vb in range(3):
        log = logs[vb + 1]
        check_snapshots(log)
        assert [e.key for e in log.items] == [it.key for it in store.items_since(vb, 0)]
    await client.aclose()


async def test_noops_keep_an_answering_consumer_and_drop_a_silent_one(
    nursery: trio.Nursery,
) -> None:
    # Short, but long enough for a loaded machine to answer within it.
    node, port = await start_node(nursery, Store(2), vbuckets=2, upr_noop_interval=0.25)
    client = await producer(port, b"noop")
    assert (await client.control("enable_noop", "true")).status == 0
    opaques = set()
    for _ in range(3):
        noop = await client.receive()
        assert isinstance(noop, upr.Noop)
        opaques.add(noop.opaque)
        await client.answer(noop)
    assert len(opaques) == 3
    # Stop answering: the producer gives up on us.
    assert isinstance(await client.receive(), upr.Noop)
    assert await client.closed_by_server()
    assert node.upr.get("noop") is None
    await client.aclose()


async def test_noop_interval_from_control(nursery: trio.Nursery) -> None:
    _, port = await start_node(nursery, Store(2), vbuckets=2, upr_noop_interval=3600)
    client = await producer(port, b"ctl-noop")
    assert (await client.control("set_noop_interval", "0.02")).status == 0
    assert (await client.control("enable_noop", "true")).status == 0
    assert isinstance(await client.receive(), upr.Noop)
    await client.aclose()


def expired_store() -> Store:
    store = Store(2)
    now = time.time()
    store.set(0, b"lives", b"1", now=now)
    store.set(0, b"expires", b"2", expiration=int(now) + 5, now=now)
    store.set(0, b"deleted", b"3", now=now)
    store.delete(0, b"deleted", now=now)
    assert len(store.expire(now + 10)) == 1
    return store


async def removals(port: int, name: bytes, open_flags: int = 0, **controls: str) -> StreamLog:
    client = await producer(port, name, open_flags)
    for key, value in controls.items():
        assert (await client.control(key, value)).status == 0
    reply = await client.stream_request(0, 0, 5, opaque=3)  # expired_store's high seqno
    assert isinstance(reply, upr.StreamRequestOk)
    log = await client.read_stream(3)
    await client.aclose()
    return log


async def test_expirations_arrive_as_such_only_when_enabled(nursery: trio.Nursery) -> None:
    store = expired_store()
    assert store.lookup(0, b"expires").kind is ItemKind.EXPIRATION
    _, port = await start_node(nursery, store, vbuckets=2)

    plain = await removals(port, b"plain")
    assert [(e.NAME, e.key) for e in plain.items] == [
        ("MUTATION", b"lives"),
        ("DELETION", b"deleted"),
        ("DELETION", b"expires"),
    ]
    # 3.0 layout: 18 bytes of extras, no delete time.
    assert [f.extras_length for f in plain.frames if f.opcode == 0x58] == [18, 18]

    timed = await removals(
        port, b"timed", upr.OpenFlags.INCLUDE_DELETE_TIMES, enable_expiry_opcode="true"
    )
    deletion, expiration = timed.items[1:]
    assert isinstance(deletion, upr.Deletion) and isinstance(expiration, upr.Expiration)
    assert deletion.delete_time == store.lookup(0, b"deleted").delete_time
    assert expiration.delete_time == store.lookup(0, b"expires").delete_time
    lengths = {f.opcode: f.extras_length for f in timed.frames if f.opcode in (0x58, 0x59)}
    assert lengths == {0x58: 21, 0x59: 20}
