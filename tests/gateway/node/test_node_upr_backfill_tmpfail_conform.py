"""A vbucket receiving its initial backfill answers STREAM_REQ with TMPFAIL.

ep-engine 3.0 src/upr-stream.cc ``PassiveStream::processMarker``: a DISK
snapshot marker into a vbucket whose high seqno is 0 puts it in the backfill
phase (open checkpoint id 0); ``PassiveStream::handleSnapshotEnd`` gives it a
checkpoint again once the item at the marker's end seqno is applied, and so
does the next marker (read in the 3.0.0-era copy: src/upr-stream.cc with the
DCP constants, couchbase/kv_engine commit 007528bb).
src/upr-producer.cc ``UprProducer::streamRequest`` answers a stream request
for a vbucket whose open checkpoint id is 0 ENGINE_TMPFAIL (0x86), right
after the vbucket-exists check, before the range checks, for notifiers too.
"""

from __future__ import annotations

import time

import pytest
import trio

from adapters import upr
from adapters.mcbp import Status
from gateway.node.items import VBucketState
from gateway.node.store import Store
from tests.support import raw_dcp as dcp
from tests.support.raw_dcp import RawDcp, producer
from tests.support.upr_client import UprClient, start_node, until

VB = 1
SF = upr.SnapshotFlags


async def feeding(port: int) -> tuple[UprClient, int]:
    """A consumer connection of the node with a stream for ``VB`` accepted: the
    test plays its producer (the client, and the stream's opaque)."""
    client = await UprClient.connect(port)
    assert (await client.open(b"replica", 0)).status == Status.SUCCESS
    assert isinstance(await client.receive(), upr.Control)  # connection_buffer_size
    added = await client.request(upr.AddStream(opaque=client.next_opaque(), vbucket=VB))
    assert isinstance(added, upr.AddStreamResponse) and added.status == Status.SUCCESS
    request = await client.receive()
    assert isinstance(request, upr.StreamRequest)
    await client.send(upr.StreamRequestOk(((0xABC, 0),), request.opaque))
    return client, request.opaque


async def refused_while_filling(port: int, vb: int, flags: int = 0) -> RawDcp:
    """Check that STREAM_REQs for ``vb`` get TMPFAIL, a notifier's too, and that
    another vbucket streams; the producer connection that asked."""
    reader = await producer(port, b"reader")
    # A bad range too: TMPFAIL comes first.
    await reader.send(dcp.stream_req(vb, opaque=10, start=9, end=3, flags=flags))
    assert (await reader.response(10)).status == Status.TEMPORARY_FAILURE
    watcher = await producer(port, b"watcher", 0x02)  # a notifier too
    await watcher.send(dcp.stream_req(vb, opaque=11))
    assert (await watcher.response(11)).status == Status.TEMPORARY_FAILURE
    await watcher.aclose()
    await reader.send(dcp.stream_req(vb - 1, opaque=12))  # other vbuckets stream
    assert (await reader.response(12)).status == 0
    return reader


@pytest.mark.parametrize("flags", [0, dcp.LATEST])
async def test_tmpfail_from_the_first_disk_marker_to_its_end(
    nursery: trio.Nursery, flags: int
) -> None:
    store = Store(4, initial_state=VBucketState.REPLICA)
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        feed, opaque = await feeding(port)
        await feed.send(
            upr.SnapshotMarker(1, 2, SF.DISK, opaque=opaque, vbucket=VB),
            upr.Mutation(b"a", b"1", by_seqno=1, rev_seqno=1, cas=1, opaque=opaque, vbucket=VB),
        )
        await until(lambda: store.high_seqno(VB) == 1)
        reader = await refused_while_filling(port, VB, flags)
        await feed.send(
            upr.Mutation(b"b", b"2", by_seqno=2, rev_seqno=1, cas=2, opaque=opaque, vbucket=VB),
            upr.SnapshotMarker(3, 3, SF.MEMORY, opaque=opaque, vbucket=VB),
            upr.Mutation(b"c", b"3", by_seqno=3, rev_seqno=1, cas=3, opaque=opaque, vbucket=VB),
        )
        await until(lambda: store.high_seqno(VB) == 3)
        await reader.send(dcp.stream_req(VB, opaque=13, end=3))
        assert (await reader.response(13)).status == 0
        await reader.aclose()
        await feed.aclose()


async def test_the_disk_snapshot_applied_to_its_end_streams_without_another_marker(
    nursery: trio.Nursery,
) -> None:
    store = Store(4, initial_state=VBucketState.REPLICA)
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        feed, opaque = await feeding(port)
        await feed.send(
            upr.SnapshotMarker(1, 2, SF.DISK, opaque=opaque, vbucket=VB),
            upr.Mutation(b"a", b"1", by_seqno=1, rev_seqno=1, cas=1, opaque=opaque, vbucket=VB),
        )
        await until(lambda: store.high_seqno(VB) == 1)
        reader = await producer(port, b"reader")
        await reader.send(dcp.stream_req(VB, opaque=10, end=1))
        assert (await reader.response(10)).status == Status.TEMPORARY_FAILURE
        await feed.send(
            upr.Mutation(b"b", b"2", by_seqno=2, rev_seqno=1, cas=2, opaque=opaque, vbucket=VB)
        )
        await until(lambda: store.high_seqno(VB) == 2)
        # handleSnapshotEnd: the snapshot's end seqno applied ends the backfill phase.
        await reader.send(dcp.stream_req(VB, opaque=11, end=2))
        assert (await reader.response(11)).status == 0
        await reader.aclose()
        await feed.aclose()


async def test_a_disk_marker_into_a_vbucket_with_data_is_no_backfill(
    nursery: trio.Nursery,
) -> None:
    store = Store(4, initial_state=VBucketState.REPLICA)
    store.apply_mutation(VB, b"old", b"v", flags=0, expiration=0, cas=9, rev_seqno=1,
                         now=time.time())  # fmt: skip
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        feed, opaque = await feeding(port)
        await feed.send(upr.SnapshotMarker(2, 5, SF.DISK, opaque=opaque, vbucket=VB))
        reader = await producer(port, b"reader")
        await feed.send(
            upr.Mutation(b"a", b"1", by_seqno=2, rev_seqno=1, cas=1, opaque=opaque, vbucket=VB)
        )
        await until(lambda: store.high_seqno(VB) == 2)
        await reader.send(dcp.stream_req(VB, opaque=10, end=2))
        assert (await reader.response(10)).status == 0
        await reader.aclose()
        await feed.aclose()
