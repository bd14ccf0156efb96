"""The TAP front answers its upstream's NOOPs while a TAP client is slow.

A 3.0 producer with NOOPs on sends one every interval whatever else flows and
drops the connection when the previous one is still unanswered at the next
(ep-engine v3.0.0 src/upr-producer.cc ``UprProducer::maybeSendNoop``: "Disconnected
because the connection appears to be dead"); NOOPs are not counted in its
flow-control buffer (``BufferLog::insert`` counts stream messages only). A
support-ack TAP client that stops acking with its window full stops the
front's pump; the NOOPs, behind a buffer's worth of items, must be answered
anyway, each once, and the client must then get every item once, in order.
"""

from __future__ import annotations

import trio

from adapters.tap import ConnectFlags, TapEvent, TapMutation, encode
from gateway.fronts.tap.session import TapSession
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import VBUCKETS, HoldingClient, mutation_keys, write_keys
from tests.support.fronts import tap_front_over_node
from tests.support.raw_dcp import NOOP
from tests.support.scripted_upr import (
    DISK,
    Channel,
    Request,
    ScriptedUpr,
    marker,
    mutation,
    noop,
    stream_end,
    stream_ok,
)
from tests.support.tap_client import TapClient, connect_event, until, wants_ack
from tests.support.tapfront import start_front

F = ConnectFlags
BUFFER = 16 * 1024
ITEMS = 400
VALUE = b"v" * 100
"""About 160 bytes a mutation: a buffer holds about 100, the stream several buffers."""
WINDOW = 40
FIRST_NOOP, SECOND_NOOP = 0xF001, 0xF002


async def test_noops_are_answered_while_the_tap_client_stalls(nursery: trio.Nursery) -> None:
    channels: list[Channel] = []

    async def play(channel: Channel, req: Request) -> None:
        channels.append(channel)
        o = req.opaque
        await channel.send(stream_ok(req))
        await channel.send_counted(marker(o, 0, ITEMS, DISK))
        keys = [b"k%04d" % n for n in range(1, ITEMS + 1)]
        await channel.send_counted(*(mutation(o, n, keys[n - 1], VALUE) for n in range(1, 61)))
        # Behind 60 items the pump cannot take while the client's window is full.
        await channel.send(noop(FIRST_NOOP))
        await channel.send_counted(
            *(mutation(o, n, keys[n - 1], VALUE) for n in range(61, ITEMS + 1)),
            stream_end(o, 0),
        )

    upr = ScriptedUpr(play, vbuckets={0: (0xABC, ITEMS)})
    upr_port = await nursery.start(upr.serve)
    front, port = await start_front(
        nursery, upr_port, buffer_size=BUFFER, ack_interval=10, max_unacked=WINDOW
    )
    events: list[TapEvent] = []

    async def read_without_acking(client: TapClient) -> None:
        while (event := await client.next_event()) is not None:
            events.append(event)

    with trio.fail_after(30):
        client = await TapClient.open(port)
        connect = connect_event(
            b"slow", F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK, backfill_date=0, vbuckets=(0,)
        )
        await client.send(encode(connect))
        async with trio.open_nursery() as reading:
            reading.start_soon(read_without_acking, client)
            await until(lambda: front.sessions.get("slow") is not None)
            session = front.sessions.get("slow")
            assert isinstance(session, TapSession)
            await until(lambda: not session.producer.can_send and bool(channels))
            # The first NOOP is in the gateway's hands already; the second follows.
            await until(lambda: _answered(upr, FIRST_NOOP))
            await channels[0].send(noop(SECOND_NOOP))
            await until(lambda: _answered(upr, SECOND_NOOP))
            # Still stalled: nothing was acked, nothing more was sent to the client.
            assert not session.producer.can_send
            assert session.producer.unacked == WINDOW
            upstream = session.upstream
            assert upstream is not None and upstream.noops_kept == 2
            # What the keeper read stays within what the producer may send.
            assert upstream.reader.buffered <= BUFFER + 1024
            reading.cancel_scope.cancel()
        # The client acks what it holds and reads on, acking as asked.
        for event in events:
            if wants_ack(event):
                await client.ack(event)  # type: ignore[arg-type]
        events += await client.collect()

    keys = [e.key for e in events if isinstance(e, TapMutation)]
    assert keys == [b"k%04d" % n for n in range(1, ITEMS + 1)]
    noop_replies = [r.opaque for r in upr.replies(NOOP)]
    assert sorted(noop_replies) == [FIRST_NOOP, SECOND_NOOP]  # each once
    assert upr.connections == 1 and upr.controls[b"enable_noop"] == b"true"


def _answered(upr: ScriptedUpr, opaque: int) -> bool:
    return any(r.opaque == opaque for r in upr.replies(NOOP))


async def test_a_3_0_node_keeps_the_connection_of_a_stalled_client(
    nursery: trio.Nursery,
) -> None:
    """The reference node drops a consumer whose NOOP is unanswered at the next
    interval, as 3.0 did (adapters/upr/producer_machine.py ``on_timer``, after
    ep-engine v3.0.0 ``UprProducer::maybeSendNoop``). With a 1-second interval,
    a client holding its acks for three NOOPs keeps its upstream connection,
    then gets every item."""
    store = Store(VBUCKETS)
    keys = write_keys(store, b"held", 2000)
    rig = await tap_front_over_node(
        nursery, store, upstream_noop_interval=1, ack_interval=20, max_unacked=100
    )
    with trio.fail_after(60):
        tap = await rig.client(b"held", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        client = HoldingClient(tap, hold_at=50)
        nursery.start_soon(client.run)
        await until(lambda: "held" in rig.front.sessions)
        session = rig.front.sessions.get("held")
        assert isinstance(session, TapSession)
        await client.wait_for(lambda: client.holding)
        await until(lambda: not session.producer.can_send)
        upstream = session.upstream
        assert upstream is not None
        # Each NOOP answered while the client holds on; one missed would have
        # cost the connection at the next.
        await until(lambda: upstream.noops_kept >= 3)
        assert session.upstream is upstream
        assert not rig.front.stats.upstream_reconnects_total
        assert not session.producer.can_send  # still held
        await client.release()
        await client.wait_for(lambda: set(keys) <= set(mutation_keys(client.events)))
    assert sorted(mutation_keys(client.events)) == sorted(keys)  # no gap, no duplicate
    assert not rig.front.stats.upstream_reconnects_total
