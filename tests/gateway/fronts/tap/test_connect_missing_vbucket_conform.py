"""A TAP CONNECT naming a vbucket the server lacks is accepted; that vbucket is skipped.

ep-engine 2.x (2.5 era): src/ep_engine.cc ``createTapQueue`` and
src/tapconnmap.cc ``TapConnMap::newProducer`` check no vbucket's existence,
and src/tapconnection.cc ``TapProducer::registerCursor`` skips a listed
vbucket it does not hold ("VBucket %d not found for TAP cursor. Skip
it...") and registers the others; a checkpoint-map entry is only read for a
vbucket it holds. TAP CONNECT has no success reply, so the client sees the
other vbuckets stream and nothing else: a dump still ends once what it has
is sent, a live connection goes on. Pinned for the reference node and the
TAP front (which counts the vbucket as lost, so a connection left with no
vbucket stays open and idle, as ``test_lost_vbucket_conform`` says).
"""

from __future__ import annotations

import time

import trio

from adapters.tap import ConnectFlags, TapMutation, TapNoop, TapResponse
from gateway.metrics.figures import TAP_FRONT
from tests.gateway.node.test_node_tap_producer import items_of
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import TapClient, connect_event, start_node, wants_ack
from tests.support.tapfront import filled_store

F = ConnectFlags
MISSING = 99
"""No store here has this vbucket (they have 4)."""


async def test_node_dump_skips_the_missing_vbucket_and_ends(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    connect = connect_event(b"d", F.LIST_VBUCKETS | F.DUMP | F.SUPPORT_ACK, vbuckets=(MISSING, 1))
    with trio.fail_after(20):
        client = await TapClient.open(port, connect)
        events = await client.collect()  # up to the close
    assert not any(isinstance(e, TapResponse) for e in events)
    assert {e.vbucket for e in items_of(events)} == {1}
    assert [e.key for e in items_of(events)] == [it.key for it in store.items_since(1, 0)]


async def test_node_live_stream_skips_the_missing_vbucket(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store)
    connect = connect_event(
        b"l",
        F.LIST_VBUCKETS | F.BACKFILL | F.CHECKPOINT | F.SUPPORT_ACK,
        backfill_date=0,
        vbuckets=(MISSING, 2),
        checkpoints=((MISSING, 5),),
    )
    backfilled = [it.key for it in store.items_since(2, 0)]
    with trio.fail_after(20):
        client = await TapClient.open(port, connect)
        seen: list[bytes] = []
        while seen != backfilled:
            batch = await client.collect(wants_ack)
            assert batch and not any(isinstance(e, TapResponse) for e in batch), batch
            assert {e.vbucket for e in items_of(batch)} <= {2}
            seen += [e.key for e in items_of(batch)]
        store.set(2, b"later", b"v", now=time.time())
        later = await client.collect(lambda e: isinstance(e, TapMutation) and e.key == b"later")
        assert later and later[-1].vbucket == 2  # the connection goes on
        await client.aclose()


async def test_front_streams_the_others_and_counts_the_skipped_one(nursery: trio.Nursery) -> None:
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    connect = connect_event(
        b"f", F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK, backfill_date=0, vbuckets=(0, MISSING)
    )
    backfilled = [it.key for it in store.items_since(0, 0)]
    with trio.fail_after(20):
        client = await TapClient.open(rig.port, connect)
        seen: list[bytes] = []
        while seen != backfilled:
            batch = await client.collect(wants_ack)
            assert batch and not any(isinstance(e, TapResponse) for e in batch), batch
            assert {e.vbucket for e in items_of(batch)} <= {0}
            seen += [e.key for e in items_of(batch)]
        store.set(0, b"later", b"v", now=time.time())
        later = await client.collect(lambda e: isinstance(e, TapMutation) and e.key == b"later")
        assert later and later[-1].vbucket == 0
        assert rig.front.stats.stream_ends_total[TAP_FRONT, "skipped"] == 1
        await client.aclose()


async def test_front_with_every_vbucket_missing_stays_open_and_idle(
    nursery: trio.Nursery,
) -> None:
    rig = await tap_front_over_node(nursery, filled_store(), noop_interval=0.1)
    connect = connect_event(b"none", F.LIST_VBUCKETS | F.SUPPORT_ACK, vbuckets=(MISSING,))
    with trio.fail_after(20):
        client = await TapClient.open(rig.port, connect)
        events = await client.collect(lambda e: isinstance(e, TapNoop))
        assert events and isinstance(events[-1], TapNoop), events  # not refused, not closed
        assert not items_of(events)
        assert isinstance(await client.next_event(), TapNoop)
        assert rig.front.stats.stream_ends_total[TAP_FRONT, "skipped"] == 1
        await client.aclose()
