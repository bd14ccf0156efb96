"""Which vbucket states the reference node streams from, as ep-engine 3.0 does.

ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest`` (hisundar/ep-engine
c8c42ea) checks only that the vbucket exists (NOT_MY_VBUCKET otherwise):
replica and pending vbuckets stream as active ones do (replica chains, views
on replicas), and so does a DEAD one, what it holds (much later servers refuse
it, kv_engine ``DcpProducer::streamRequest``). Every stream of
a vbucket ends STATE_CHANGED (2) once the vbucket changes state, whichever it
was (src/ep.cc ``setVBucketState`` -> ``UprConnMap::vbucketStateChanged`` ->
``setDead(END_STREAM_STATE)``), a replica promoted to active included.
"""

from __future__ import annotations

import struct
import time

import pytest
import trio

from gateway.node.items import VBucketState
from tests.support import raw_dcp as dcp
from tests.support.fronts import filled
from tests.support.raw_dcp import producer, read_stream
from tests.support.upr_client import start_node

NOT_MY_VBUCKET = 0x07
END_OK, END_STATE_CHANGED = 0, 2


def end_flag(message: dcp.Reply) -> int:
    assert message.opcode == dcp.STREAM_END, message
    return int(struct.unpack(">I", message.extras)[0])


@pytest.mark.parametrize("state", [VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD])
async def test_replica_pending_and_dead_vbuckets_stream(
    nursery: trio.Nursery, state: VBucketState
) -> None:
    store = filled(40)
    store.set_state(1, state, now=time.time())
    high = store.high_seqno(1)
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        client = await producer(port, b"from-" + state.name.lower().encode())
        await client.send(dcp.stream_req(1, opaque=10, end=high))
        assert (await client.response(10)).status == 0
        messages = await read_stream(client, 10)
        seqnos = [m.by_seqno for m in messages if m.opcode == dcp.MUTATION]
        assert seqnos[-1] == high and len(seqnos) == 10
        assert end_flag(messages[-1]) == END_OK
        await client.aclose()


async def test_a_replica_streams_what_replication_writes_into_it(nursery: trio.Nursery) -> None:
    store = filled(40)
    store.set_state(2, VBucketState.REPLICA, now=time.time())
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        client = await producer(port, b"chain")
        await client.send(dcp.stream_req(2, opaque=10))
        assert (await client.response(10)).status == 0
        store.apply_mutation(
            2, b"replicated", b"v", flags=0, expiration=0, cas=77, rev_seqno=1, now=time.time()
        )
        while True:
            got = await client.next()
            assert got is not None
            if got.opcode == dcp.MUTATION and got.key == b"replicated":
                break
        await client.aclose()


async def test_a_vbucket_the_node_does_not_have_is_not_my_vbucket(
    nursery: trio.Nursery,
) -> None:
    store = filled(8)
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        client = await producer(port, b"late")
        await client.send(dcp.stream_req(store.n_vbuckets, opaque=10))
        assert (await client.response(10)).status == NOT_MY_VBUCKET
        await client.aclose()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (VBucketState.REPLICA, VBucketState.ACTIVE),  # a promotion
        (VBucketState.ACTIVE, VBucketState.REPLICA),
        (VBucketState.PENDING, VBucketState.ACTIVE),
    ],
)
async def test_any_state_change_ends_the_vbuckets_streams(
    nursery: trio.Nursery, before: VBucketState, after: VBucketState
) -> None:
    store = filled(40)
    store.set_state(3, before, now=time.time())
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        client = await producer(port, b"watcher")
        await client.send(dcp.stream_req(3, opaque=10))
        assert (await client.response(10)).status == 0
        # The backfill first (memcached's NOOP 0x0a answered after it), then the change.
        await client.send(dcp.frame(dcp.MC_NOOP, opaque=11))
        while (got := await client.next()) is not None and got.opaque != 11:
            pass
        store.set_state(3, after, now=time.time())
        messages = await read_stream(client, 10)
        assert end_flag(messages[-1]) == END_STATE_CHANGED
        await client.aclose()
