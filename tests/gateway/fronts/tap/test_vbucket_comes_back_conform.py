"""A vbucket whose upstream state changed keeps streaming on the same TAP connection.

ep-engine 2.x: a TAP producer's checkpoint cursor lives in the vbucket's
``CheckpointManager`` and ``VBucket::setState`` (src/vbucket.cc) leaves it
alone; ``TapProducer::nextFgFetched_UNLOCKED`` (src/tapconnection.cc) skips a
vbucket that is dead ("in invalid state") on each walk and takes its items
again once it is not, from where the cursor stood. So a vbucket that went dead
and came back active or replica streamed on, on the same connection, with
nothing in between. Only a deleted vbucket takes the cursor along: a vbucket
created again under the same id has none (src/checkpoint.cc
``CheckpointManager::nextItem``: the cursor "is not found", nothing is sent).

The TAP front reads a 3.0 upstream, which ends a stream STATE_CHANGED on any
notified state change (src/ep.cc ``setVBucketState`` ->
``UprProducer::vbucketStateChanged``) and takes a stream request for a
vbucket in any state, dead included (src/upr-producer.cc
``UprProducer::streamRequest`` checks no state). So the front requests the
stream again from the last seqno sent, with the vbucket's uuid: the TAP
client gets what comes next, with no reset. A vbucket the upstream then
lacks (NOT_MY_VBUCKET: deleted) is lost for good, as 2.x's cursor was
(``test_lost_vbucket_conform.py``).
"""

from __future__ import annotations

import trio

from adapters.tap import ConnectFlags, OpaqueCode, TapMutation, TapOpaque
from gateway.metrics.figures import TAP_FRONT
from tests.support.fronts import tap_front_over_scripted
from tests.support.raw_dcp import RES, STREAM_REQ, frame
from tests.support.scripted_upr import (
    MEMORY,
    Channel,
    Request,
    ScriptedUpr,
    marker,
    mutation,
    stream_end,
    stream_ok,
)
from tests.support.tap_client import until

F = ConnectFlags
STATE_CHANGED = 2
TMPFAIL = 0x86
INITIAL = OpaqueCode.INITIAL_VBUCKET_STREAM


async def test_a_vbucket_whose_state_changed_streams_on(nursery: trio.Nursery) -> None:
    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if req.start == 0:  # the first request: one item, then the state changes
            await channel.send(stream_ok(req), marker(o, 1, 1, MEMORY), mutation(o, 1, b"a"))
            await channel.send(stream_end(o, STATE_CHANGED))
        else:  # alive again: what was written since
            await channel.send(stream_ok(req), marker(o, 2, 2, MEMORY), mutation(o, 2, b"b"))

    upr = ScriptedUpr(play, vbuckets={0: (0xABC, 1)})
    rig = await tap_front_over_scripted(nursery, upr)
    with trio.fail_after(20):
        client = await rig.client(
            b"back", F.LIST_VBUCKETS | F.BACKFILL, backfill_date=0, vbuckets=(0,)
        )
        events = await client.collect(lambda e: isinstance(e, TapMutation) and e.key == b"b")
        keys = [e.key for e in events if isinstance(e, TapMutation)]
        assert keys == [b"a", b"b"]
        # No reset in between: the client keeps what it had.
        resets = [e for e in events if isinstance(e, TapOpaque) and e.opaque_code == INITIAL]
        assert len(resets) == 1, events  # the backfill's own, before "a"
        # Requested again on the same upstream connection, from where it stood.
        assert [(r.vbucket, r.start, r.uuid) for r in upr.requests] == [(0, 0, 0), (0, 1, 0xABC)]
        assert (upr.requests[1].snap_start, upr.requests[1].snap_end) == (1, 1)
        assert upr.connections == 1 and upr.closed == 0
        ends = rig.front.stats.stream_ends_total
        assert ends[TAP_FRONT, "state_changed"] == 1
        assert not [k for k in ends if k[1].startswith("refused")]
        await client.aclose()
        await until(lambda: not rig.front.sessions.holds("back"))


async def test_a_vbucket_being_filled_is_asked_again(nursery: trio.Nursery) -> None:
    """TMPFAIL (src/upr-producer.cc ``UprProducer::streamRequest``: the vbucket
    is in its backfill state, open checkpoint id 0) is not a loss: a 2.x cursor
    waited there (src/checkpoint.cc ``CheckpointManager::nextItem``: "still in
    backfill phase"), so the front asks again with backoff."""
    answers = [TMPFAIL, TMPFAIL]

    async def play(channel: Channel, req: Request) -> None:
        o = req.opaque
        if answers:
            status = answers.pop(0)
            await channel.send(frame(STREAM_REQ, magic=RES, vbucket=status, opaque=o))
            return
        await channel.send(stream_ok(req), marker(o, 1, 1, MEMORY), mutation(o, 1, b"a"))

    upr = ScriptedUpr(play, vbuckets={0: (0xABC, 1)})
    rig = await tap_front_over_scripted(nursery, upr)
    with trio.fail_after(20):
        client = await rig.client(
            b"fill", F.LIST_VBUCKETS | F.BACKFILL, backfill_date=0, vbuckets=(0,)
        )
        events = await client.collect(lambda e: isinstance(e, TapMutation))
        assert [e.key for e in events if isinstance(e, TapMutation)] == [b"a"]
        assert [r.start for r in upr.requests] == [0, 0, 0]
        assert upr.connections == 1
        assert not [k for k in rig.front.stats.stream_ends_total if k[1].startswith("refused")]
        await client.aclose()
