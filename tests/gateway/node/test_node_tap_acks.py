"""The node's TAP producer with support-ack: window, retransmit, registered clients, NOOPs."""

from __future__ import annotations

import time
from collections.abc import Sequence

import trio

from adapters.mcbp import Opcode, Status
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapDelete,
    TapEvent,
    TapMutation,
    TapNoop,
    TapStreamMessage,
)
from gateway.io.connection import PacketConnection, RequestFailed
from gateway.node.store import Store
from gateway.node.tap_plan import Phase
from tests.support.tap_client import (
    TapClient,
    connect_event,
    is_opaque,
    start_node,
    until,
    wants_ack,
)

F = ConnectFlags
ACKED_BACKFILL = F.BACKFILL | F.SUPPORT_ACK | F.LIST_VBUCKETS


def store_with(n_items: int, vbuckets: int = 2) -> Store:
    store = Store(vbuckets)
    now = time.time()
    for i in range(n_items):
        store.set(i % vbuckets, b"key-%04d" % i, b"value-%d" % i, now=now)
    return store


def item_keys(events: Sequence[TapEvent], vb: int | None = None) -> list[bytes]:
    return [
        e.key
        for e in events
        if isinstance(e, TapMutation | TapDelete) and (vb is None or e.vbucket == vb)
    ]


async def test_a_slow_acker_gets_everything_within_the_window(nursery: trio.Nursery) -> None:
    store = store_with(300, vbuckets=1)
    node, port = await start_node(
        nursery, store, vbuckets=1, tap_ack_interval=10, tap_max_unacked=30
    )
    connect = connect_event(b"slow", ACKED_BACKFILL, backfill_date=0, vbuckets=(0,))
    events: list[TapStreamMessage] = []
    stalls = 0
    with trio.fail_after(5):
        client = await TapClient.open(port, connect)
        await until(lambda: node.tap.get("slow") is not None)
        stream = node.tap.get("slow")
        acked = 0
        while not any(is_opaque(e, OpaqueCode.CLOSE_BACKFILL) for e in events):
            # Read all the node has sent; it stops at the window until we ack.
            await until(
                lambda: not stream.producer.can_send or stream.cursors[0].phase is Phase.LIVE
            )
            while not events or events[-1].opaque < stream.last_stamped:
                events.append(await client.message())
            if not stream.producer.can_send:
                stalls += 1
            assert stream.last_stamped - acked <= 30
            request = max((e for e in events if wants_ack(e)), key=lambda e: e.opaque)
            await client.ack(request)
            acked = request.opaque
            await until(lambda n=acked: stream.last_acked == n)  # type: ignore[misc]
        await client.aclose()
    assert stalls >= 300 // 30 - 1
    assert item_keys(events) == [it.key for it in store.items_since(0, 0)]
    stats = stream.connection_figures()
    assert stats["supports_ack"] is True and stats["rec_fetched"] == 300


async def test_busy_nack_resends_the_same_sequence_numbers(nursery: trio.Nursery) -> None:
    store = store_with(40, vbuckets=1)
    node, port = await start_node(
        nursery, store, vbuckets=1, tap_ack_interval=5, tap_max_unacked=10
    )
    connect = connect_event(b"busy", ACKED_BACKFILL, backfill_date=0, vbuckets=(0,))
    with trio.fail_after(5):
        client = await TapClient.open(port, connect)
        first = await client.message()
        assert is_opaque(first, OpaqueCode.ENABLE_AUTO_NACK) and wants_ack(first)
        stream = node.tap.get("busy")
        # The window fills: 10 messages, none acked.
        await until(lambda: not stream.producer.can_send)
        sent = [first] + [await client.message() for _ in range(9)]
        assert [e.opaque for e in sent] == list(range(1, 11))
        await client.ack(first, Status.BUSY)
        # After the backoff everything unacked comes again, in order, unchanged.
        again = [await client.message() for _ in range(10)]
        assert again == sent
        await client.ack(again[-1])
        rest = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL))
        await client.aclose()
    assert item_keys([*sent, *rest]) == [it.key for it in store.items_since(0, 0)]
    stats = stream.connection_figures()
    assert stats["num_tap_nack"] == 1 and stats["num_tap_tmpfail_survivors"] == 10


async def test_other_nacks_close_the_stream(nursery: trio.Nursery) -> None:
    """A nack other than TMPFAIL/EBUSY disconnects the client (ep-engine 2.5.1
    tapconnection.cc, TapProducer::processAck: the default case returns
    ENGINE_DISCONNECT)."""
    node, port = await start_node(nursery, store_with(10))
    connect = connect_event(b"picky", ACKED_BACKFILL, backfill_date=0, vbuckets=(0,))
    with trio.fail_after(5):
        async with await TapClient.open(port, connect) as client:
            first = await client.message()
            await until(lambda: node.tap.get("picky") is not None)
            await client.ack(first, Status.KEY_EXISTS, b"no thanks")
            after_nack: list[TapEvent] = []
            while (event := await client.next_event()) is not None:
                after_nack.append(event)  # what the node had already queued
            # The node closed the connection (next_event saw the end) and let go of it.
            await until(lambda: node.tap.get("picky") is None)
    # Vbucket 0 holds 5 items; none is sent twice and no registration keeps a position.
    keys = [e.key for e in (first, *after_nack) if isinstance(e, TapMutation)]
    assert len(keys) == len(set(keys)) <= 5
    assert node.tap.registration("picky") is None


async def test_registered_client_resumes_by_name(nursery: trio.Nursery) -> None:
    store = store_with(40)
    node, port = await start_node(nursery, store, vbuckets=2, tap_ack_interval=1)
    flags = F.REGISTERED_CLIENT | ACKED_BACKFILL | F.CHECKPOINT
    connect = connect_event(b"reg", flags, backfill_date=0, vbuckets=(0, 1))
    with trio.fail_after(5):
        client = await TapClient.open(port, connect)
        events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 1))
        store.set(0, b"live-1", b"x", now=time.time())
        events += await client.collect(lambda e: getattr(e, "key", None) == b"live-1")
        registration = node.tap.registration("reg")
        await until(lambda: registration.positions[0].seqno == store.high_seqno(0))
        await client.aclose()
        for vb in (0, 1):
            assert item_keys(events, vb) == [it.key for it in store.items_since(vb, 0)]
        # While it is away: more writes; the reconnect gets just those.
        now = time.time()
        for name in (b"away-1", b"away-2"):
            store.set(0, name, b"y", now=now)
        store.set(1, b"away-3", b"z", now=now)
        client = await TapClient.open(port, connect)
        events = await client.collect(lambda e: getattr(e, "key", None) == b"away-3")
        assert not any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM) for e in events)
        assert item_keys(events) == [b"away-1", b"away-2", b"away-3"]
        offline = dict(node.tap.stats())
        assert offline["eq_tapq:reg:reconnects"] == "1"
        # Deregistered (memcached 0x9e): its connection closes, its position is gone.
        async with await PacketConnection.connect("127.0.0.1", port) as admin:
            await admin.request(Opcode.DEREGISTER_TAP_CLIENT, key=b"reg")
            try:
                await admin.request(Opcode.DEREGISTER_TAP_CLIENT, key=b"reg")
            except RequestFailed as exc:
                assert exc.status == Status.KEY_NOT_FOUND
            else:
                raise AssertionError("deregistered twice")
        assert await client.collect() is not None and client.closed
        await client.aclose()
        client = await TapClient.open(port, connect)
        events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 1))
        assert any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM, 0) for e in events)
        await client.aclose()


async def test_registered_client_without_acks_resumes_after_what_was_sent(
    nursery: trio.Nursery,
) -> None:
    store = store_with(10)
    node, port = await start_node(nursery, store, vbuckets=2)
    flags = F.REGISTERED_CLIENT | F.BACKFILL | F.LIST_VBUCKETS
    connect = connect_event(b"noack", flags, backfill_date=0, vbuckets=(1,))
    with trio.fail_after(5):
        async with await TapClient.open(port, connect) as client:
            await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 1))
            await until(lambda: node.tap.get("noack").idle)
        store.set(1, b"later", b"v", now=time.time())
        async with await TapClient.open(port, connect) as client:
            events = await client.collect(lambda e: getattr(e, "key", None) == b"later")
    assert item_keys(events) == [b"later"]


async def test_idle_stream_gets_noops_and_stats(nursery: trio.Nursery) -> None:
    node, port = await start_node(nursery, store_with(4), tap_noop_interval=0.05)
    connect = connect_event(b"quiet", F.LIST_VBUCKETS | F.SUPPORT_ACK, vbuckets=(0, 1))
    with trio.fail_after(5):
        async with await TapClient.open(port, connect) as client:
            await client.ack(await client.message())
            assert isinstance(await client.next_event(), TapNoop)
            assert isinstance(await client.next_event(), TapNoop)
            await until(lambda: node.tap.get("quiet").idle)
            stats = dict(node.tap.stats())
            assert stats["ep_tap_count"] == "1"
            assert stats["eq_tapq:quiet:idle"] == "true"
            assert stats["eq_tapq:quiet:vb_filters"] == "2"
            assert int(stats["eq_tapq:quiet:total_noops"]) >= 2
            assert node.tap.takeover_stats(0, "quiet")["estimate"] == "0"
            assert node.tap.takeover_stats(2, "quiet") is None
            assert node.tap.takeover_stats(0, "nobody") is None
            # The same over memcached STAT.
            async with await PacketConnection.connect("127.0.0.1", port) as admin:
                over_wire = await admin.stats("tap")
                takeover = await admin.stats("vbucket-takeover 1 quiet")
            assert over_wire["eq_tapq:quiet:vb_filters"] == "2"
            assert over_wire["eq_tapq:quiet:supports_ack"] == "true"
            assert takeover["name"] == "eq_tapq:quiet" and takeover["estimate"] == "0"
            assert takeover["vb_items"] == "2"
