"""The node's TAP producer over loopback: backfill, live, checkpoints, dump, filters."""

from __future__ import annotations

import time

import trio

from adapters.mcbp import Magic, Status, encode_frame
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapEvent,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapOpcode,
    TapResponse,
    TapStreamMessage,
    encode,
)
from gateway.node.items import Item, VBucketState
from gateway.node.store import Store
from tests.support.tap_client import (
    FUTURE,
    STREAM_TYPES,
    TapClient,
    connect_event,
    is_opaque,
    start_node,
    until,
)
from tests.support.tapfront import filled_store

VBUCKETS = 4
F = ConnectFlags


def swapped(flags: int) -> int:
    return int.from_bytes(flags.to_bytes(4, "big"), "little")


def items_of(events: list[TapEvent], vb: int | None = None) -> list[TapMutation | TapDelete]:
    return [
        e
        for e in events
        if isinstance(e, TapMutation | TapDelete) and (vb is None or e.vbucket == vb)
    ]


def items_and_markers(events: list[TapEvent]) -> list[TapStreamMessage]:
    return [e for e in events if isinstance(e, STREAM_TYPES) and not isinstance(e, TapOpaque)]  # type: ignore[misc]


def expected(item: Item, *, network_order: bool = False) -> tuple[object, ...]:
    if item.deleted:
        return ("DELETE", item.key, item.cas, item.rev_seqno)
    flags = item.flags if network_order else swapped(item.flags)
    return ("MUTATION", item.key, item.cas, item.rev_seqno, item.value, flags, item.expiration)


def got(event: TapMutation | TapDelete) -> tuple[object, ...]:
    if isinstance(event, TapDelete):
        return ("DELETE", event.key, event.cas, event.rev_seqno)
    return (
        "MUTATION",
        event.key,
        event.cas,
        event.rev_seqno,
        event.value,
        event.flags,
        event.expiration,
    )


def assert_equals_store(
    events: list[TapEvent], store: Store, vb: int, *, network_order: bool = False
) -> None:
    """Per vbucket: every key's latest version, once, in seqno order."""
    want = [expected(it, network_order=network_order) for it in store.items_since(vb, 0)]
    assert [got(e) for e in items_of(events, vb)] == want


def backfill_bounds(events: list[TapEvent], vb: int) -> tuple[int, int]:
    start = next(
        i for i, e in enumerate(events) if is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM, vb)
    )
    end = next(i for i, e in enumerate(events) if is_opaque(e, OpaqueCode.CLOSE_BACKFILL, vb))
    return start, end


async def test_backfill_of_every_vbucket_equals_the_store(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(
            port, connect_event(b"bf", F.BACKFILL, backfill_date=0)
        ) as client:
            last_close = lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, VBUCKETS - 1)  # noqa: E731
            events = await client.collect(last_close)
    for vb in range(VBUCKETS):
        assert_equals_store(events, store, vb)
        start, end = backfill_bounds(events, vb)
        # The vbucket's items all lie between its INITIAL_VBUCKET_STREAM and CLOSE_BACKFILL.
        inside = {id(e) for e in events[start:end]}
        assert all(id(e) in inside for e in items_of(events, vb))
    # No ack requests without support-ack; TTL 255; 2.x metadata on every item.
    assert all(not e.tap_flags & TapFlags.ACK for e in items_of(events))
    assert all(e.ttl == 255 for e in items_of(events))
    assert all(e.nru is not None for e in items_of(events) if isinstance(e, TapMutation))
    opaques = [e.opaque for e in events if isinstance(e, TapMutation | TapDelete | TapOpaque)]
    assert opaques == sorted(opaques) and len(set(opaques)) == len(opaques)


async def test_only_active_vbuckets_unless_listed(nursery: trio.Nursery) -> None:
    store = filled_store()
    store.set_state(1, VBucketState.REPLICA, now=time.time())
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        async with await TapClient.open(
            port, connect_event(b"all", F.BACKFILL, backfill_date=0)
        ) as client:
            events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 3))
        assert {e.vbucket for e in items_of(events)} == {0, 2, 3}
        listed = connect_event(
            b"some", F.BACKFILL | F.LIST_VBUCKETS, backfill_date=0, vbuckets=(1, 3)
        )
        async with await TapClient.open(port, listed) as client:
            events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 3))
    assert {e.vbucket for e in items_of(events)} == {1, 3}
    assert_equals_store(events, store, 1)
    assert_equals_store(events, store, 3)


async def test_live_changes_follow_the_backfill_inside_checkpoints(nursery: trio.Nursery) -> None:
    """With the CHECKPOINT flag (2.5.1 tapconnection.cc ``supportCheckpointSync_``)."""
    store = filled_store(checkpoint_items=5)
    _, port = await start_node(nursery, store)
    flags = F.BACKFILL | F.LIST_VBUCKETS | F.CHECKPOINT
    with trio.fail_after(5):
        client = await TapClient.open(
            port, connect_event(b"live", flags, backfill_date=0, vbuckets=(2,))
        )
        events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 2))
        backfilled = len(items_of(events))
        now = time.time()
        for i in range(12):
            store.set(2, b"new-%d" % i, b"live-%d" % i, now=now)
        store.delete(2, b"key-1", now=now)
        # An expiration travels as a DELETE too.
        store.set(2, b"ttl", b"short", expiration=int(now) + 1, now=now)
        assert [it.key for it in store.expire(now + 5)] == [b"ttl"]
        events += await client.collect(lambda e: isinstance(e, TapDelete) and e.key == b"ttl")
        await client.aclose()
    live = events[
        events.index(next(e for e in events if is_opaque(e, OpaqueCode.CLOSE_BACKFILL))) :
    ]
    news = [b"new-%d" % i for i in range(12)]
    assert [e.key for e in items_of(live)] == [*news, b"key-1", b"ttl"]
    assert [type(e) for e in items_of(live)][-2:] == [TapDelete, TapDelete]
    assert len(items_of(events)) == backfilled + 14
    # Every live item sits between CHECKPOINT_START and CHECKPOINT_END of its checkpoint.
    current = None
    ids = []
    for event in live:
        if isinstance(event, TapCheckpointStart):
            assert current is None
            current = event.checkpoint_id
            ids.append(current)
        elif isinstance(event, TapCheckpointEnd):
            assert event.checkpoint_id == current
            current = None
        elif isinstance(event, TapMutation | TapDelete):
            assert current == store.lookup(2, event.key).checkpoint_id  # type: ignore[union-attr]
    assert ids == sorted(ids) and len(ids) >= 3  # 5 items per checkpoint
    assert sum(isinstance(e, TapCheckpointEnd) for e in live) >= len(ids) - 1


async def test_future_backfill_date_sends_only_new_changes(nursery: trio.Nursery) -> None:
    store = filled_store()
    node, port = await start_node(nursery, store)
    with trio.fail_after(5):
        connect = connect_event(
            b"new", F.BACKFILL | F.LIST_VBUCKETS, backfill_date=FUTURE, vbuckets=(0,)
        )
        async with await TapClient.open(port, connect) as client:
            await until(lambda: node.tap.get("new") is not None and node.tap.get("new").idle)
            store.set(0, b"fresh", b"x", now=time.time())
            events = await client.collect(lambda e: isinstance(e, TapMutation))
    assert [e.key for e in items_of(events)] == [b"fresh"]
    assert not any(isinstance(e, TapOpaque) for e in events)


async def test_dump_wraps_each_vbucket_like_a_backfill_then_closes(nursery: trio.Nursery) -> None:
    """ep-engine 2.x tapconnection.cc: ``registerCursor`` schedules a DUMP as a
    backfill of each ACTIVE vbucket holding items (``scheduleBackfill_UNLOCKED``
    queues OPAQUE(INITIAL_VBUCKET_STREAM), ``checkBackfillCompletion_UNLOCKED``
    OPAQUE(CLOSE_BACKFILL)); an empty or replica vbucket sends nothing."""
    store = filled_store()
    store.set_state(2, VBucketState.REPLICA, now=time.time())
    store.reset_vbucket(3)  # active and empty
    _, port = await start_node(nursery, store)
    store_vbs = (0, 1)
    listed = connect_event(b"dump", F.DUMP | F.LIST_VBUCKETS, vbuckets=(0, 1, 2, 3))
    with trio.fail_after(5):
        async with await TapClient.open(port, listed) as client:
            events = await client.collect()  # until the node closes
    opaques = [e for e in events if isinstance(e, TapOpaque)]
    assert [(e.opaque_code, e.vbucket) for e in opaques] == [
        (code, vb)
        for vb in store_vbs
        for code in (OpaqueCode.INITIAL_VBUCKET_STREAM, OpaqueCode.CLOSE_BACKFILL)
    ]
    assert all(isinstance(e, TapMutation | TapDelete | TapOpaque) for e in events)
    assert {e.vbucket for e in items_of(events)} == set(store_vbs)
    for vb in store_vbs:
        assert_equals_store(events, store, vb)
        start, end = backfill_bounds(events, vb)
        assert all(events.index(e) in range(start, end) for e in items_of(events, vb))


async def test_keys_only_and_flag_byte_order(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    flags = F.DUMP | F.KEYS_ONLY | F.FIX_FLAG_BYTEORDER | F.LIST_VBUCKETS
    with trio.fail_after(5):
        async with await TapClient.open(
            port, connect_event(b"keys", flags, vbuckets=(1,))
        ) as client:
            events = await client.collect()
    mutations = [e for e in items_of(events) if isinstance(e, TapMutation)]
    live = [it for it in store.items_since(1, 0) if not it.deleted]
    assert [(m.key, m.flags) for m in mutations] == [(it.key, it.flags) for it in live]
    assert all(m.value == b"" for m in mutations)
    assert all(m.tap_flags & TapFlags.NO_VALUE for m in mutations)
    assert all(m.tap_flags & TapFlags.NETWORK_BYTE_ORDER for m in mutations)


async def test_checkpoint_resume_and_fallback_to_backfill(nursery: trio.Nursery) -> None:
    store = filled_store(checkpoint_items=10, checkpoint_history=3)
    _, port = await start_node(nursery, store)
    listing = store.checkpoints(0)
    assert listing[0].id > 1  # the oldest checkpoints were forgotten
    resume_from = listing[0]
    flags = F.CHECKPOINT | F.LIST_VBUCKETS | F.SUPPORT_ACK
    with trio.fail_after(5):
        # Resume after a checkpoint still kept: no backfill, the rest in checkpoints.
        connect = connect_event(
            b"cp", flags, vbuckets=(0, 1), checkpoints=((0, resume_from.id), (1, 0))
        )
        last = store.items_since(0, 0)[-1]
        async with await TapClient.open(port, connect) as client:
            # Backfills come first, then live items.
            events = await client.collect(
                lambda e: (
                    isinstance(e, TapDelete | TapMutation) and (e.vbucket, e.key) == (0, last.key)
                )
            )
    assert is_opaque(events[0], OpaqueCode.ENABLE_AUTO_NACK)
    assert is_opaque(events[1], OpaqueCode.ENABLE_CHECKPOINT_SYNC)
    assert not any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM, 0) for e in events)
    after = [it.key for it in store.items_since(0, resume_from.end_seqno)]
    assert [e.key for e in items_of(events, 0)] == after
    assert isinstance(
        next(e for e in items_and_markers(events) if e.vbucket == 0),
        TapCheckpointStart,
    )
    # Vbucket 1's client has no checkpoint and checkpoint 1 is gone: a full
    # backfill that resets the receiver first.
    assert any(is_opaque(e, OpaqueCode.INITIAL_VBUCKET_STREAM, 1) for e in events)
    assert_equals_store(events, store, 1)


async def test_connect_the_node_cannot_serve_is_refused(nursery: trio.Nursery) -> None:
    _, port = await start_node(nursery, filled_store())
    refused = [
        connect_event(b"tko", F.TAKEOVER_VBUCKETS),
        connect_event(b"tko0", F.TAKEOVER_VBUCKETS | F.LIST_VBUCKETS, vbuckets=()),
    ]
    with trio.fail_after(5):
        for connect in refused:
            async with await TapClient.open(port, connect) as client:
                reply = await client.next_event()
                assert isinstance(reply, TapResponse), connect
                assert reply.status == Status.NOT_SUPPORTED and reply.text
                assert await client.next_event() is None


async def test_malformed_connect_is_refused_and_others_carry_on(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(5):
        good = await TapClient.open(port, connect_event(b"good", F.LIST_VBUCKETS, vbuckets=(0,)))
        bad = await TapClient.open(port)
        # LIST_VBUCKETS announcing 5 vbuckets but carrying one.
        await bad.send(
            bytes.fromhex("80400003040000000000000b000000070000000000000000")
            + b"\x00\x00\x00\x04bad\x00\x05\x00\x01"
        )
        reply = await bad.next_event()
        assert isinstance(reply, TapResponse) and reply.status == Status.NOT_SUPPORTED
        assert b"vbuckets" in reply.text and reply.opaque == 7
        assert await bad.next_event() is None
        store.set(0, b"after", b"v", now=time.time())
        events = await good.collect(lambda e: isinstance(e, TapMutation))
        assert items_of(events)[-1].key == b"after"
        await good.aclose()
        await bad.aclose()


async def test_garbage_from_a_tap_client_closes_only_its_stream(nursery: trio.Nursery) -> None:
    """A malformed TAP packet closes its stream; a memcached command does not
    (memcached 2.x daemon/memcached.c ``conn_ship_log`` answers it as on any
    connection; see test_tap_2x_clients)."""
    store = filled_store()
    _, port = await start_node(nursery, store)
    flags = F.SUPPORT_ACK | F.LIST_VBUCKETS
    with trio.fail_after(5):
        good = await TapClient.open(port, connect_event(b"good", flags, vbuckets=(0,)))
        await good.ack(await good.message())
        junk = [
            # A TAP mutation too short for its extras: refused by name, then closed.
            (
                Status.INVALID_ARGUMENTS,
                encode_frame(Magic.REQUEST, TapOpcode.MUTATION, opaque=5, key=b"k"),
            ),
            # A nack that is neither EBUSY nor ETMPFAIL: closed (ep-engine 2.5.1
            # src/tapconnection.cc ``TapProducer::processAck``).
            (None, encode(TapResponse(TapOpcode.MUTATION, opaque=1, status=Status.KEY_EXISTS))),
        ]
        for status, packet in junk:
            async with await TapClient.open(port, connect_event(b"junk", flags)) as client:
                await client.ack(await client.message())
                await client.send(packet)
                frames = []
                while (frame := await client.next_frame()) is not None:
                    frames.append(frame)
            replies = [f for f in frames if f.magic == Magic.RESPONSE]
            if status is None:
                assert not replies
            else:
                assert [(f.opcode, f.opaque) for f in replies] == [(TapOpcode.MUTATION, 5)]
                assert replies[0].vbucket_or_status == status and replies[0].value
        # An ack of a sequence number never sent is ignored, as processAck did.
        await good.send(encode(TapResponse(TapOpcode.MUTATION, opaque=999)))
        store.set(0, b"still", b"here", now=time.time())
        events = await good.collect(lambda e: isinstance(e, TapMutation))
        assert items_of(events)[-1].key == b"still"
        await good.aclose()
