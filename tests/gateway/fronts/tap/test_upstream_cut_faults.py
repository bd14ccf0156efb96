"""The TAP front's upstream UPR connection cut (both sockets closed), or its
node restarted, while a support-ack client holds unacked messages: mid
backfill (one DISK snapshot) and mid live snapshot (a MEMORY snapshot, a
checkpoint open on the TAP side). (A node SIGKILLed mid-backfill:
test_tap_front_upstream_kill.)

The client's TAP connection is the gateway's, not the upstream's: it stays
open, the messages it had not acked stay in the ack window until it acks them
(ep-engine 2.5.1 src/tapconnection.cc ``TapProducer::processAck`` keeps an ack
log per connection whatever happens behind it), and the stream goes on from
the last seqno sent, inside the snapshot that was open: no gap, no duplicate,
no vbucket started over, the checkpoint brackets whole.
"""

from __future__ import annotations

from pathlib import Path

import trio

from adapters.tap import ConnectFlags, TapCheckpointStart
from gateway.io.listen import bound_port
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import (
    VBUCKETS,
    CutProxy,
    HoldingClient,
    mutation_keys,
    resets,
    versions_in_order,
    write_keys,
)
from tests.support.tap_client import TapClient, connect_event, start_node, until
from tests.support.tapfront import Replica, check_brackets, node_state, start_front

F = ConnectFlags


async def _cut_while_held(
    nursery: trio.Nursery, store: Store, flags: ConnectFlags, *, live: int
) -> tuple[HoldingClient, object, CutProxy]:
    _, node_port = await start_node(nursery, store)
    proxy = CutProxy(node_port)
    proxy_port = await nursery.start(proxy.serve)
    # A window of 100 messages fills long before the 1 MiB upstream buffer: the
    # front stops on the held acks with upstream items in its socket and buffer.
    front, port = await start_front(
        nursery, proxy_port, buffer_size=1024 * 1024, max_unacked=100, ack_interval=20
    )
    tap = await TapClient.open(port, connect_event(b"held", flags, backfill_date=0))
    client = HoldingClient(tap, hold_at=150)
    nursery.start_soon(client.run)
    if live:
        # Live only: wait for the stream to be up, then write one burst per vbucket.
        await until(lambda: "held" in front.sessions)
        session = front.sessions.get("held")
        await until(lambda: session.upstream is not None and session.streams.vbuckets)
        write_keys(store, b"live", live, size=1000)
    await client.wait_for(lambda: client.holding)
    session = front.sessions.get("held")
    # The front stopped on the full window, with messages the client never acked.
    await until(lambda: not session.producer.can_send)
    await client.wait_for(lambda: client.held)  # (read, maybe after the window filled)
    assert session.producer.unacked == 100
    if live:
        # ... inside a live snapshot: a checkpoint is open on the TAP side.
        assert any(
            vb.translator.last_seqno < vb.translator.snap_end for vb in session.vbuckets.values()
        )
    proxy.cut()
    await client.release()
    await until(lambda: sum(front.stats.upstream_reconnects_total.values()) >= 1)
    assert front.sessions.get("held") is session, "the TAP client lost its connection"
    return client, front, proxy


async def test_upstream_cut_mid_backfill_with_unacked_messages(nursery: trio.Nursery) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"bf", 2000, size=1000)
    with trio.fail_after(30):
        client, _, _ = await _cut_while_held(
            nursery, store, F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT, live=0
        )
        await client.wait_for(lambda: client.mutations >= 2000)
    got = mutation_keys(client.events)
    assert len(got) == 2000 and set(got) == set(keys)  # no gap, no duplicate
    assert sorted(resets(client.events)) == list(range(VBUCKETS))  # none started over
    versions_in_order(client.events)
    check_brackets(client.events)


async def test_upstream_cut_mid_live_snapshot_with_unacked_messages(
    nursery: trio.Nursery,
) -> None:
    store = Store(VBUCKETS)
    with trio.fail_after(30):
        client, _, _ = await _cut_while_held(nursery, store, F.SUPPORT_ACK | F.CHECKPOINT, live=800)
        await client.wait_for(lambda: client.mutations >= 800)
        more = write_keys(store, b"after", 40)
        await client.wait_for(lambda: client.mutations >= 840)
    got = mutation_keys(client.events)
    assert len(got) == len(set(got)) == 840 and set(more) <= set(got)
    assert not resets(client.events)
    versions_in_order(client.events)
    check_brackets(client.events)
    assert any(isinstance(e, TapCheckpointStart) for e in client.events)
    replica = Replica()
    replica.apply(client.events)
    assert replica.items == node_state(store, range(VBUCKETS))


async def test_node_restarted_mid_live_snapshot_with_unacked_messages(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS, data_dir=tmp_path / "node")
    config = NodeConfig(vbuckets=VBUCKETS, tap_noop_interval=0.5)
    node_scope = trio.CancelScope()
    stopped = trio.Event()

    async def run_node(store: Store, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        try:
            with node_scope:
                async with trio.open_nursery() as inner:
                    listeners = await inner.start(Node(store, config).serve, "127.0.0.1", port)
                    task_status.started(bound_port(listeners))
        finally:
            stopped.set()  # its listener and connections are closed: the port is free

    node_port = await nursery.start(run_node, store, 0)
    front, port = await start_front(
        nursery, node_port, buffer_size=1024 * 1024, max_unacked=100, ack_interval=20
    )
    with trio.fail_after(30):
        tap = await TapClient.open(port, connect_event(b"held", F.SUPPORT_ACK | F.CHECKPOINT))
        client = HoldingClient(tap, hold_at=150)
        nursery.start_soon(client.run)
        await until(lambda: "held" in front.sessions)
        session = front.sessions.get("held")
        await until(lambda: session.upstream is not None and session.streams.vbuckets)
        write_keys(store, b"live", 800, size=1000)
        await client.wait_for(lambda: client.holding and client.held)
        await until(lambda: not session.producer.can_send)
        assert any(
            vb.translator.last_seqno < vb.translator.snap_end for vb in session.vbuckets.values()
        )
        node_scope.cancel()  # the node goes away mid-snapshot
        await stopped.wait()
        store.close()
        store = Store(VBUCKETS, data_dir=tmp_path / "node")
        more = write_keys(store, b"after", 40)
        node_scope = trio.CancelScope()
        stopped = trio.Event()
        await nursery.start(run_node, store, node_port)
        await client.release()
        await client.wait_for(lambda: client.mutations >= 840)
        assert front.sessions.get("held") is session, "the TAP client lost its connection"
        assert sum(front.stats.upstream_reconnects_total.values()) >= 1
    got = mutation_keys(client.events)
    assert len(got) == len(set(got)) == 840 and set(more) <= set(got)  # no gap, no duplicate
    assert not resets(client.events)
    versions_in_order(client.events)
    check_brackets(client.events)
    node_scope.cancel()
    store.close()
