"""Consumers of the UPR front: expirations, flow control, many consumers, STAT, auth, draft."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from adapters import upr
from adapters.mcbp import Magic, Opcode, Status, encode_frame
from gateway.io.connection import PacketConnection, RequestFailed
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    caught_up,
    filled_store,
    final_state,
    start_front,
    start_node,
    store_state,
    until,
    write_load,
)
from tests.support.fronts import upr_front_over_node
from tests.support.upr_client import StreamLog, UprClient, check_snapshots


async def test_expirations_arrive_as_expiration_only_when_asked(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store(10)
    rig = await upr_front_over_node(nursery, tmp_path, store)
    now = time.time()
    store.set(0, b"short-lived", b"x", expiration=int(now), now=now)
    store.set(0, b"deleted", b"x", expiration=int(now) + 3600, now=now)
    with trio.fail_after(10):
        await until(lambda: caught_up(rig.front, store))  # the gateway knows the expirations
    store.delete(0, b"deleted", now=now)
    store.expire(now + 1)
    await rig.catch_up()
    high = rig.front.logs.logs[0].high_seqno

    async def kinds(name: bytes, expiry: bool, flags: int = 0) -> dict[bytes, upr.UprEvent]:
        client = await rig.consumer(name, flags)
        if expiry:
            assert (await client.control("enable_expiry_opcode", "true")).status == 0
        await client.stream_request(0, 0, high, opaque=5)
        log = await client.read_stream(5)
        await client.aclose()
        return {e.key: e for e in log.items}

    plain = await kinds(b"old", False)
    assert isinstance(plain[b"short-lived"], upr.Deletion)
    assert isinstance(plain[b"deleted"], upr.Deletion)
    assert plain[b"short-lived"].delete_time is None
    asked = await kinds(b"new", True, upr.OpenFlags.INCLUDE_DELETE_TIMES)
    expired = asked[b"short-lived"]
    assert isinstance(expired, upr.Expiration) and expired.delete_time
    assert isinstance(asked[b"deleted"], upr.Deletion)


async def test_tiny_buffer_stalls_only_that_consumer(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    slow = await rig.consumer(b"slow")
    assert (await slow.control("connection_buffer_size", "300")).status == 0
    high = rig.front.logs.logs[0].high_seqno
    await slow.stream_request(0, 0, high, opaque=1)
    # It reads but never acks: the gateway stops at the window.
    got = 0
    early = StreamLog()
    with trio.move_on_after(0.3):
        while True:
            received = await slow.receive_sized()
            early.events.append(received.event)
            early.frames.append(received.frame)
            got += received.size
    assert 0 < got <= 300 + 200
    conn = rig.front.connections["slow"]
    assert conn.window.unacked_bytes == slow.unacked and not conn.window.can_send
    # Another consumer on the same vbucket streams it whole meanwhile.
    fast = await rig.consumer(b"fast")
    await fast.stream_request(0, 0, high, opaque=2)
    whole = await fast.read_stream(2)
    assert final_state(whole) == store_state(store, 0)
    # Acking as it goes, the slow one gets everything too.
    await slow.ack_buffer()
    log = await slow.read_stream(1, ack_buffer=True, log=early)
    check_snapshots(log)
    assert final_state(log) == store_state(store, 0)
    stats = conn.stream_stats
    assert stats.buffer_size == 300 and stats.blocked_seconds > 0
    assert stats.vbuckets[0].acked_seqno == log.items[-1].by_seqno
    assert stats.latency.count > 0
    await slow.aclose()
    await fast.aclose()


async def test_flow_control_turned_off_mid_batch_sends_the_rest(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """CONTROL connection_buffer_size 0 drops the buffer log (ep-engine v3.0.0
    src/upr-producer.cc ``UprProducer::control``): a batch held by the window
    mid-way goes on unacknowledged."""
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    client = await rig.consumer(b"held")
    assert (await client.control("connection_buffer_size", "300")).status == 0
    high = rig.front.logs.logs[0].high_seqno
    await client.stream_request(0, 0, high, opaque=1)
    conn = rig.front.connections["held"]
    with trio.fail_after(10):
        await until(lambda: not conn.window.can_send and conn.streams_waiting > 0)
    assert (await client.control("connection_buffer_size", "0")).status == 0
    with trio.fail_after(10):
        log = await client.read_stream(1)
    check_snapshots(log)
    assert final_state(log) == store_state(store, 0)
    assert log.items[-1].by_seqno == high
    await client.aclose()


async def test_fifty_consumers_share_one_upstream_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store(20)
    rig = await upr_front_over_node(nursery, tmp_path, store, node={"checkpoint_interval": 0.05})
    results: dict[int, list[StreamLog]] = {}

    async def consume(i: int) -> None:
        client = await rig.consumer(b"c%d" % i)
        for vb in range(VBUCKETS):
            await client.stream_request(vb, 0, MAX_SEQNO, opaque=vb + 1)
        logs = []
        await until(lambda: caught_up(rig.front, store) and load_done.is_set())
        streams = rig.front.connections[f"c{i}"].streams
        # Everything logged has been sent (buffer acks keep it moving).
        await until(
            lambda: all(
                s.position >= rig.front.logs.logs[vb].high_seqno for vb, s in streams.items()
            )
        )
        for vb in range(VBUCKETS):
            await client.request(upr.CloseStream(opaque=99, vbucket=vb))
            logs.append(client.take_pending(vb + 1))
        results[i] = logs
        await client.aclose()

    load_done = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as inner:
            for i in range(50):
                inner.start_soon(consume, i)
            await write_load(store, 300)
            load_done.set()
    assert len(results) == 50
    for logs in results.values():
        for vb, log in enumerate(logs):
            assert final_state(log) == store_state(store, vb)
    assert rig.front.ingest.connections == 1
    assert rig.front.stats.connections_total["upr_front"] == 50


async def test_stat_groups_on_the_upr_port(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    consumer = await rig.consumer(b"replica")
    await consumer.stream_request(3, 0, MAX_SEQNO, opaque=1)
    async with await PacketConnection.connect("127.0.0.1", rig.port) as client:
        seqnos = await client.stats("vbucket-seqno")
        assert seqnos["vb_3:high_seqno"] == str(rig.front.logs.logs[3].high_seqno)
        assert seqnos["vb_3:uuid"] == str(rig.front.logs.logs[3].failover.uuid)
        with trio.fail_after(5):
            while (await client.stats("vbucket-takeover 3 replica"))["estimate"] != "0":
                await trio.sleep(0.01)
        upr_stats = await client.stats("dcp")
        assert upr_stats["eq_dcpq:replica:stream_3_state"] == "in-memory"
        assert "eq_dcpq:replica:stream_3_markers_sent" in upr_stats  # as the node names it
        try:
            await client.stats("vbucket-takeover 3 nobody")
            raise AssertionError("unknown stream must fail")
        except RequestFailed as exc:
            assert exc.status == Status.KEY_NOT_FOUND
    await consumer.aclose()


async def test_consumers_must_authenticate_when_users_are_set(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store(5)
    _, node_port = await start_node(nursery, store, users={"node": "pw"})
    front, port, _ = await start_front(
        nursery,
        tmp_path,
        node_port,
        users={"alice": "secret"},
        upstream_user="node",
        upstream_password="pw",
    )
    with trio.fail_after(10):
        await until(lambda: caught_up(front, store))
    client = await UprClient.connect(port)
    refused = await client.open(b"anonymous", upr.OpenFlags.PRODUCER)
    assert refused.status == Status.AUTH_ERROR

    def sasl(password: bytes, opaque: int) -> bytes:
        return encode_frame(Magic.REQUEST, Opcode.SASL_AUTH, opaque=opaque, key=b"PLAIN",
                            value=b"\x00alice\x00" + password)  # fmt: skip

    async def raw_status() -> int:
        while (frame := client.reader.next_frame()) is None:
            client.reader.receive_data(await client.stream.receive_some(65536))
        return frame.vbucket_or_status

    await client.send_raw(sasl(b"wrong", 1))
    assert await raw_status() == Status.AUTH_ERROR
    await client.send_raw(sasl(b"secret", 2))
    assert await raw_status() == Status.SUCCESS
    assert (await client.open(b"alice", upr.OpenFlags.PRODUCER)).status == Status.SUCCESS
    reply = await client.stream_request(1, 0, front.logs.logs[1].high_seqno, opaque=4)
    assert isinstance(reply, upr.StreamRequestOk)
    log = await client.read_stream(4)
    assert final_state(log) == store_state(store, 1)
    await client.aclose()


async def test_draft_dialect_consumers(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store, dialect="upr-draft")
    await rig.catch_up()
    client = await rig.consumer(dialect=upr.UPR_DRAFT)
    reply = await client.stream_request(2, 0, rig.front.logs.logs[2].high_seqno, opaque=8)
    assert isinstance(reply, upr.StreamRequestOk)
    log = await client.read_stream(8)
    assert isinstance(log.events[0], upr.StreamStart)
    assert (
        sum(isinstance(e, upr.SnapshotStart) for e in log.events)
        == sum(isinstance(e, upr.SnapshotEnd) for e in log.events)
        > 0
    )
    assert final_state(log) == store_state(store, 2)
    await client.aclose()


async def test_without_flow_control_acked_follows_sent_and_log_size_follows_the_disk(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up()
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.seg"))
    assert rig.front.stats.upr_log.bytes_on_disk == on_disk > 0
    client = await rig.consumer(b"no-window")
    high = rig.front.logs.logs[0].high_seqno
    await client.stream_request(0, 0, high, opaque=1)
    log = await client.read_stream(1)
    assert log.items[-1].by_seqno == high
    progress = rig.front.connections["no-window"].stream_stats.vbuckets[0]
    assert progress.sent_seqno == progress.acked_seqno == high
    # The log grows with live writes, and so does its size in the stats.
    store.set(0, b"grown", b"x" * 5000, now=time.time())
    await rig.catch_up()
    grown = sum(p.stat().st_size for p in tmp_path.rglob("*.seg"))
    assert rig.front.stats.upr_log.bytes_on_disk == grown > on_disk + 5000
    await client.aclose()
