"""The node's TAP producer: a vbucket that went dead and came back streams on.

ep-engine 2.x src/tapconnection.cc ``TapProducer::nextFgFetched_UNLOCKED``
skips a vbucket that is dead ("in invalid state") on each walk, and
``VBucket::setState`` (src/vbucket.cc) leaves the connection's checkpoint
cursor in place; once the vbucket is active (or replica) again the walk takes
what was written since, from where the cursor stood, on the same connection
and with no reset. (The node never deletes a vbucket, the one case where 2.x
lost the cursor for good.)
"""

from __future__ import annotations

import time

import trio

from adapters.tap import ConnectFlags, OpaqueCode, TapMutation, TapNoop, TapOpaque
from gateway.node.items import VBucketState
from gateway.node.store import Store
from tests.support.tap_client import TapClient, connect_event, is_opaque, start_node

F = ConnectFlags


async def test_a_dead_vbucket_that_comes_back_streams_on(nursery: trio.Nursery) -> None:
    store = Store(2)
    now = time.time()
    store.set(0, b"before", b"x", now=now)
    _, port = await start_node(nursery, store, vbuckets=2, tap_noop_interval=0.05)
    connect = connect_event(b"back", F.BACKFILL | F.LIST_VBUCKETS, backfill_date=0, vbuckets=(0,))
    with trio.fail_after(10):
        client = await TapClient.open(port, connect)
        events = await client.collect(lambda e: is_opaque(e, OpaqueCode.CLOSE_BACKFILL, 0))
        store.set_state(0, VBucketState.DEAD, now=time.time())
        # Dead: the connection stays, idle (a NOOP), and sends nothing of it.
        idle = await client.collect(lambda e: isinstance(e, TapNoop))
        assert not [e for e in idle if not isinstance(e, TapNoop)]
        store.set_state(0, VBucketState.ACTIVE, now=time.time())
        store.set(0, b"after", b"y", now=time.time())
        events += await client.collect(lambda e: isinstance(e, TapMutation) and e.key == b"after")
        await client.aclose()
    keys = [e.key for e in events if isinstance(e, TapMutation)]
    assert keys == [b"before", b"after"]
    resets = [e for e in events if isinstance(e, TapOpaque)]
    assert [e.opaque_code for e in resets] == [
        OpaqueCode.INITIAL_VBUCKET_STREAM,
        OpaqueCode.CLOSE_BACKFILL,
    ]  # the backfill's only: no reset when it came back
