"""TAP front CONNECT modes: dump, list vbuckets, keys only, byte order, takeover, bad input."""

from __future__ import annotations

import time

import trio

from adapters.mcbp import Status
from adapters.mcbp.constants import VBucketState
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapResponse,
    TapVbucketSet,
)
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import TapClient, connect_event
from tests.support.tapfront import Replica, catch_up, check_brackets, filled_store, node_state

F = ConnectFlags
VBUCKETS = 4


async def test_dump_sends_everything_once_then_closes(nursery: trio.Nursery) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    with trio.fail_after(20):
        client = await rig.client(b"dump", F.DUMP | F.SUPPORT_ACK | F.BACKFILL, backfill_date=0)
        events = await client.collect()  # up to the close, acking as asked
    replica = Replica()
    replica.apply(events)
    assert replica.items == node_state(store, range(VBUCKETS))
    expected = sum(len(store.items_since(vb, 0)) for vb in range(VBUCKETS))
    assert replica.mutations + replica.deletes == expected
    check_brackets(events)


async def test_dump_wraps_each_active_vbucket_holding_items(nursery: trio.Nursery) -> None:
    """ep-engine 2.x tapconnection.cc: ``registerCursor`` turns a DUMP into a
    backfill of each ACTIVE vbucket holding items, so each comes between
    OPAQUE(INITIAL_VBUCKET_STREAM) (``scheduleBackfill_UNLOCKED``) and
    OPAQUE(CLOSE_BACKFILL) (``checkBackfillCompletion_UNLOCKED``); a replica or
    an empty vbucket sends nothing."""
    store = filled_store()
    store.set_state(2, VBucketState.REPLICA, now=time.time())
    store.reset_vbucket(3)  # active and empty
    rig = await tap_front_over_node(nursery, store)
    # The value of a 2.x CONNECT with DUMP | LIST_VBUCKETS: count, then the vbuckets.
    connect = bytes.fromhex("804000040400000000000012000000000000000000000000")
    connect += b"\x00\x00\x00\x06" + b"dp0d" + bytes.fromhex("00040000000100020003")
    with trio.fail_after(20):
        client = await TapClient.open(rig.port)
        await client.send(connect)
        events = await client.collect()  # up to the close
    opaques = [e for e in events if isinstance(e, TapOpaque)]
    assert {e.vbucket for e in opaques} == {0, 1}  # the streams interleave
    for vb in (0, 1):
        assert [e.opaque_code for e in opaques if e.vbucket == vb] == [
            OpaqueCode.INITIAL_VBUCKET_STREAM,
            OpaqueCode.CLOSE_BACKFILL,
        ]
    check_brackets(events)
    replica = Replica()
    replica.apply(events)
    assert replica.items == node_state(store, (0, 1))


async def test_listed_vbuckets_keys_only_in_network_order(nursery: trio.Nursery) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    flags = F.BACKFILL | F.LIST_VBUCKETS | F.KEYS_ONLY | F.FIX_FLAG_BYTEORDER | F.DUMP
    with trio.fail_after(20):
        client = await rig.client(b"keys", flags, backfill_date=0, vbuckets=(2, 3))
        events = await client.collect()
    mutations = [e for e in events if isinstance(e, TapMutation)]
    assert {m.vbucket for m in mutations} == {2, 3}
    assert all(m.value == b"" and m.tap_flags & TapFlags.NO_VALUE for m in mutations)
    assert all(m.tap_flags & TapFlags.NETWORK_BYTE_ORDER for m in mutations)
    by_key = {(m.vbucket, m.key): m.flags for m in mutations}
    expected = {k: v[3] for k, v in node_state(store, (2, 3)).items()}
    assert by_key == expected  # flags as stored, not swapped


async def test_takeover_leaves_the_client_active_and_the_source_dead(
    nursery: trio.Nursery,
) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    flags = F.BACKFILL | F.LIST_VBUCKETS | F.TAKEOVER_VBUCKETS | F.SUPPORT_ACK
    replica = Replica()
    with trio.fail_after(20):
        client = await rig.client(b"mover", flags, backfill_date=0, vbuckets=(1, 2))
        events = await client.collect()  # the front closes once every ack is in
    replica.apply(events)
    states = [(e.vbucket, e.state) for e in events if isinstance(e, TapVbucketSet)]
    for vb in (1, 2):
        assert [s for v, s in states if v == vb] == [VBucketState.PENDING, VBucketState.ACTIVE]
        assert store.state(vb) is VBucketState.DEAD
    assert store.state(0) is VBucketState.ACTIVE
    assert replica.items == node_state(store, (1, 2))
    check_brackets(events)


async def test_malformed_connect_is_refused_and_other_clients_carry_on(
    nursery: trio.Nursery,
) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    replica = Replica()
    with trio.fail_after(20):
        good = await rig.client(b"good", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        bad = await TapClient.open(rig.port)
        # LIST_VBUCKETS announcing 5 vbuckets but carrying one.
        await bad.send(
            bytes.fromhex("80400003040000000000000b000000070000000000000000")
            + b"\x00\x00\x00\x04bad\x00\x05\x00\x01"
        )
        answer = await bad.next_event()
        assert isinstance(answer, TapResponse) and answer.status == Status.NOT_SUPPORTED
        assert b"vbuckets" in answer.text and answer.opaque == 7
        assert await bad.next_event() is None
        store.set(0, b"after", b"v", now=time.time())
        await catch_up(good, replica, store)
        await good.aclose()


async def test_an_upstream_speaking_the_transport_draft(nursery: trio.Nursery) -> None:
    store = filled_store()
    rig = await tap_front_over_node(
        nursery, store, node={"dialect": "upr-draft"}, dialect="upr-draft"
    )
    replica = Replica()
    with trio.fail_after(20):
        client = await TapClient.open(
            # checkpoints (2.5.1 tapconnection.cc ``supportCheckpointSync_``) bracket its items
            rig.port,
            connect_event(b"draft", F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT, backfill_date=0),
        )
        events = await catch_up(client, replica, store)
        store.set(3, b"live", b"after", now=time.time())
        events += await catch_up(client, replica, store)
        await client.aclose()
    check_brackets(events)
    assert sorted(replica.resets) == list(range(VBUCKETS))
