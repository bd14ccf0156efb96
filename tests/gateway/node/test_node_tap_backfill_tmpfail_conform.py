"""A vbucket filled over TAP answers STREAM_REQ with TMPFAIL until its first checkpoint.

ep-engine 3.0: TAP OPAQUE(INITIAL_VBUCKET_STREAM) resets the vbucket
(src/tapconnection.cc ``TapConsumer::processOpaqueCommand`` calls
``resetVBucket``), which creates it afresh: src/ep.cc
``EventuallyPersistentStore::setVBucketState`` opens checkpoint 2 for an
active vbucket and checkpoint 0 for any other. ``processCheckpointCommand``
ends that phase at a CHECKPOINT_START of an id over 0 and opens the id, and
src/vbucket.cc ``VBucket::setState`` opens at least checkpoint 2 when the
vbucket becomes active.
Meanwhile src/upr-producer.cc ``UprProducer::streamRequest`` answers a
vbucket whose open checkpoint id is 0 ENGINE_TMPFAIL (0x86), before the
range checks, for notifiers too.
"""

from __future__ import annotations

import pytest
import trio

from adapters.tap import (
    OpaqueCode,
    TapCheckpointStart,
    TapFlags,
    TapMutation,
    TapResponse,
    TapVbucketSet,
)
from adapters.tap import TapOpaque as Opaque
from gateway.node.items import VBucketState
from gateway.node.tap_receiver import TapReceiver
from tests.gateway.node.test_node_tap_receiver import exchange, replica_store
from tests.gateway.node.test_node_upr_backfill_tmpfail_conform import refused_while_filling
from tests.support import raw_dcp as dcp
from tests.support.tap_client import TapClient
from tests.support.upr_client import start_node

VB = 1
ACK = TapFlags.ACK
INITIAL = OpaqueCode.INITIAL_VBUCKET_STREAM


def item(key: bytes, vb: int = VB, opaque: int = 0) -> TapMutation:
    return TapMutation(key, b"v", vb, opaque=opaque, cas=1, rev_seqno=1, tap_flags=ACK)


def acked(replies: list[object], count: int) -> bool:
    return len(replies) == count and all(
        isinstance(r, TapResponse) and r.status == 0 for r in replies
    )


async def test_tmpfail_from_initial_vbucket_stream_to_the_first_checkpoint(
    nursery: trio.Nursery,
) -> None:
    store = replica_store()
    _, port = await start_node(nursery, store)
    with trio.fail_after(20):
        async with await TapClient.open(port) as sender:
            backfill = [Opaque(INITIAL, VB, opaque=1, tap_flags=ACK), item(b"a", opaque=2)]
            assert acked(await exchange(sender, *backfill), 2)
            reader = await refused_while_filling(port, VB)
            live = [TapCheckpointStart(1, VB, opaque=3, tap_flags=ACK), item(b"b", opaque=4)]
            assert acked(await exchange(sender, *live), 2)
            await reader.send(dcp.stream_req(VB, opaque=13, end=2))
            assert (await reader.response(13)).status == 0
            await reader.aclose()


def test_an_initial_stream_refused_on_an_active_vbucket_starts_no_backfill() -> None:
    store = replica_store()
    backfill: set[int] = set()
    receiver = TapReceiver(store, backfill)
    assert receiver.receive(Opaque(INITIAL, 3, opaque=1, tap_flags=ACK))  # the nack
    assert backfill == set()


@pytest.mark.parametrize(
    "ending",
    [
        TapCheckpointStart(5, VB),
        TapVbucketSet(VBucketState.ACTIVE, VB),
    ],
    ids=["checkpoint_start", "becomes_active"],
)
def test_the_first_checkpoint_or_becoming_active_ends_the_backfill(ending: object) -> None:
    store = replica_store()
    backfill: set[int] = set()
    receiver = TapReceiver(store, backfill)
    receiver.receive(Opaque(INITIAL, VB))
    receiver.receive(item(b"a"))
    receiver.receive(TapVbucketSet(VBucketState.PENDING, VB))  # not active: still filling
    assert backfill == {VB}
    receiver.receive(item(b"b", vb=0))  # another vbucket's checkpoint is not this one's
    receiver.receive(TapCheckpointStart(2, 0))
    receiver.receive(TapCheckpointStart(0, VB))  # id 0: still the backfill phase
    assert backfill == {VB}
    receiver.receive(ending)  # type: ignore[arg-type]
    assert backfill == set()
