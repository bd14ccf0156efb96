"""TAP front resilience: slow clients, registered clients, upstream loss, rollback."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from adapters.mcbp import Status
from adapters.tap import ConnectFlags, OpaqueCode, TapEvent, TapMutation, TapNoop
from gateway.io.listen import bound_port
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import (
    TapClient,
    connect_event,
    is_opaque,
    until,
    wants_ack,
)
from tests.support.tapfront import (
    Replica,
    catch_up,
    check_brackets,
    closes,
    filled_store,
    node_state,
    start_front,
)

F = ConnectFlags
VBUCKETS = 4


def write_keys(store: Store, prefix: bytes, count: int) -> None:
    now = time.time()
    for i in range(count):
        store.set(i % VBUCKETS, b"%s-%05d" % (prefix, i), b"v" * 50, now=now)


async def test_a_client_that_stops_acking_stalls_the_upstream_within_bounds(
    nursery: trio.Nursery,
) -> None:
    store = Store(VBUCKETS)
    write_keys(store, b"slow", 4000)
    rig = await tap_front_over_node(
        nursery, store, buffer_size=32 * 1024, max_unacked=300, ack_interval=100
    )
    with trio.fail_after(20):
        client = await rig.client(b"slow", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        received: list[TapEvent] = []
        # Read without acking until the front stops sending.
        while True:
            with trio.move_on_after(0.3) as idle:
                received.append(await client.next_event())
            if idle.cancelled_caught:
                break
        session = rig.front.sessions.get("slow")
        assert session.producer.unacked <= 300
        # The producer stops once the buffer is reached: at most one message past it.
        assert session.stats.unacked_bytes <= 32 * 1024 + 200
        assert session.stats.acks_pending == session.producer.unacked
        assert len([e for e in received if isinstance(e, TapMutation)]) < 4000
        # Acking the last message that asked releases the rest of the stream.
        replica = Replica()
        replica.apply(received)
        asked = [e for e in received if wants_ack(e)]
        await client.ack(asked[-1])
        await catch_up(client, replica, store)
        assert replica.mutations == 4000


async def test_registered_client_resumes_where_it_acked(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store, state_dir=tmp_path)
    flags = F.BACKFILL | F.SUPPORT_ACK | F.REGISTERED_CLIENT | F.CHECKPOINT
    replica = Replica()
    with trio.fail_after(20):
        first = await rig.client(b"reg", flags, backfill_date=0)
        events: list[TapEvent] = []
        while closes(events) < VBUCKETS:
            batch = await first.collect(wants_ack)
            replica.apply(batch)
            events.extend(batch)
        await first.aclose()
        await until(lambda: "reg" not in rig.front.sessions)
        write_keys(store, b"while-away", 40)
        second = await rig.client(b"reg", flags, backfill_date=0)
        resumed = await catch_up(second, replica, store)
        assert not any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM) for e in resumed)
        keys = [e.key for e in resumed if isinstance(e, TapMutation)]
        assert sorted(keys) == sorted(b"while-away-%05d" % i for i in range(40))
        await second.aclose()
    assert (tmp_path / "tap-front-state.msgpack").exists()


async def test_upstream_restart_mid_stream_leaves_no_gap_and_no_duplicate(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS, data_dir=tmp_path / "node")
    write_keys(store, b"before", 3000)
    config = NodeConfig(vbuckets=VBUCKETS, tap_noop_interval=0.5)
    node_scope = trio.CancelScope()
    node_stopped = trio.Event()

    async def run_node(store: Store, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        nonlocal node_stopped
        node_stopped = stopped = trio.Event()
        try:
            with node_scope:
                async with trio.open_nursery() as inner:
                    listeners = await inner.start(Node(store, config).serve, "127.0.0.1", port)
                    task_status.started(bound_port(listeners))
        finally:
            stopped.set()  # its listener and connections are closed: the port is free

    node_port = await nursery.start(run_node, store, 0)
    front, port = await start_front(nursery, node_port, buffer_size=16 * 1024)
    replica = Replica()
    with trio.fail_after(30):
        client = await TapClient.open(
            port, connect_event(b"survivor", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        )
        events: list[TapEvent] = []
        while replica.mutations < 500:
            batch = await client.collect(wants_ack)
            replica.apply(batch)
            events.extend(batch)
        node_scope.cancel()  # the node dies mid-backfill
        await node_stopped.wait()
        store.close()
        store = Store(VBUCKETS, data_dir=tmp_path / "node")
        write_keys(store, b"after", 200)
        node_scope = trio.CancelScope()
        await nursery.start(run_node, store, node_port)
        events += await catch_up(client, replica, store)
        keys = [e.key for e in events if isinstance(e, TapMutation)]
        assert len(keys) == len(set(keys)) == 3200
        assert not replica.resets[VBUCKETS:]  # no vbucket was reset again
        assert front.stats.upstream_reconnects_total
        check_brackets(events)
        await client.aclose()
        node_scope.cancel()
        store.close()


async def test_failover_below_the_client_rolls_the_vbucket_back_to_a_backfill(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    write_keys(store, b"old", 400)
    rig = await tap_front_over_node(nursery, store, state_dir=tmp_path)
    flags = F.BACKFILL | F.SUPPORT_ACK | F.REGISTERED_CLIENT
    replica = Replica()
    with trio.fail_after(20):
        first = await rig.client(b"rb", flags, backfill_date=0)
        await catch_up(first, replica, store)
        await first.aclose()
        await until(lambda: "rb" not in rig.front.sessions)
        high = store.high_seqno(1)
        store.rollback(1, high - 20)  # a replica that had less took over
        store.failover(1)
        write_keys(store, b"new", 8)
        second = await rig.client(b"rb", flags, backfill_date=0)
        resumed = await catch_up(second, replica, store)
        assert [e.vbucket for e in resumed if is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM)] == [
            1
        ]
        assert rig.front.stats.rollbacks_total["tap_front"] == 1
        assert replica.items == node_state(store, range(VBUCKETS))
        await second.aclose()


async def test_a_busy_nack_makes_the_front_resend_from_the_first_unacked(
    nursery: trio.Nursery,
) -> None:
    store = Store(VBUCKETS)
    write_keys(store, b"nack", 200)
    rig = await tap_front_over_node(nursery, store, ack_interval=50, backoff=0.05)
    with trio.fail_after(20):
        client = await rig.client(b"busy", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        first = await client.collect(wants_ack, auto_ack=False)  # up to the first ack request
        await client.ack(first[-1], status=Status.BUSY, text=b"replica queue full")
        again = await client.collect(wants_ack, auto_ack=False)
        # What came before the nacked message was acked by the nack (ep-engine
        # 2.5.1 src/tapconnection.cc ``TapProducer::processAck``): the resend
        # starts with the nacked message.
        assert again[0] == first[-1]
        replica = Replica()
        replica.apply(first[:-1] + again)
        await client.ack(again[-1])
        await catch_up(client, replica, store)
        assert replica.mutations == 200
        assert rig.front.stats.active("tap_front")[0].nacks_total == 1
        assert rig.front.stats.active("tap_front")[0].retransmits_total >= 1


async def test_an_idle_stream_gets_noops(nursery: trio.Nursery) -> None:
    rig = await tap_front_over_node(nursery, node={"vbuckets": VBUCKETS}, noop_interval=0.1)
    with trio.fail_after(10):
        client = await rig.client(b"idle", F(0))
        event = await client.next_event()
        assert isinstance(event, TapNoop)
