"""The node's CHECKPOINT_START carries the vbucket's max deleted rev_seqno.

ep-engine 2.5.1 src/ep_engine.cc ``doWalkTapQueue`` packs the vbucket's
``getMaxDeletedRevSeqno()`` as CHECKPOINT_START's 8 engine-specific bytes
(src/tapconnection.cc ``TapEngineSpecific::packSpecificData``; CHECKPOINT_END
has none), and a 2.5.1 consumer sets its own from them (``tapNotify``), so a
key recreated there after its tombstone was purged gets a higher rev_seqno.
"""

from __future__ import annotations

import struct
import time

import trio

from adapters.tap import ConnectFlags as F
from adapters.tap import TapCheckpointEnd, TapCheckpointStart
from gateway.node.store import Store
from tests.support.tap_client import TapClient, connect_event, start_node, until


async def test_checkpoint_start_carries_the_max_deleted_rev_seqno(nursery: trio.Nursery) -> None:
    store = Store(1)
    now = time.time()
    for rev in range(5):
        store.set(0, b"gone", b"v%d" % rev, now=now)
    store.delete(0, b"gone", now=now)
    assert store.purge_tombstones(now + 1, 0) == 1
    deleted_rev = store.vbucket(0).max_deleted_rev  # type: ignore[union-attr]
    assert deleted_rev >= 6
    node, port = await start_node(nursery, store, vbuckets=1)
    connect = connect_event(b"cp", F.BACKFILL | F.CHECKPOINT, backfill_date=(1 << 64) - 1)
    with trio.fail_after(10):
        async with await TapClient.open(port, connect) as client:
            await until(lambda: node.tap.get("cp") is not None)  # live from here on
            store.set(0, b"live", b"x", now=time.time())
            events = await client.collect(lambda e: isinstance(e, TapCheckpointStart))
            start = events[-1]
            store.close_checkpoint(0)
            store.set(0, b"next", b"y", now=time.time())
            events = await client.collect(lambda e: isinstance(e, TapCheckpointEnd))
    assert isinstance(start, TapCheckpointStart)
    assert start.engine_specific == struct.pack(">Q", deleted_rev)
    end = events[-1]
    assert isinstance(end, TapCheckpointEnd) and end.engine_specific == b""
