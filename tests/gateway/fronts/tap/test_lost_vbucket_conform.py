"""A TAP connection outlives the vbuckets it loses, as a 2.x producer's did.

ep-engine 2.x src/tapconnection.cc: ``TapProducer::registerCursor`` skips a
vbucket it does not hold ("VBucket %d not found for TAP cursor. Skip it...")
and the connection goes on; the producer closes a connection on its own only
when a dump or a takeover is done (``checkDumpOrTakeOverCompletion``: "
Disconnecting tap stream"), and an idle one gets NOOPs (ep_engine.cc
``walkTapQueue``, ``isTimeForNoop``). So once every vbucket of a live TAP
connection ended because the upstream refused its stream or ended it for a
reason other than OK, the front closes its upstream and keeps the TAP
connection open and idle, sending NOOPs, until the client closes it. (A
STREAM_END STATE_CHANGED alone loses nothing: the stream is requested again,
``test_vbucket_comes_back_conform.py``; a vbucket then refused, deleted
upstream, is lost as 2.x's cursor went with its vbucket.) A dump
still closes once what it could serve is acked, and a connection whose every
stream was served to its end (STREAM_END OK) closes as before.
"""

from __future__ import annotations

import pytest
import trio

from adapters.tap import ConnectFlags, TapEvent, TapMutation, TapNoop
from gateway.fronts.tap.server import TapFront
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
from tests.support.tap_client import TapClient, until

F = ConnectFlags
LIVE = F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK
NOT_MY_VBUCKET = 0x07


def two_vbuckets(play_of: dict[int, str]) -> ScriptedUpr:
    """A producer of vbuckets 0 and 1: "refuse" answers NOT_MY_VBUCKET, "state"
    streams one item then ends with STATE_CHANGED and answers the stream's next
    request NOT_MY_VBUCKET (the vbucket was deleted), "live" streams one item and
    stays open, "ok" streams one item then ends OK."""
    asked: set[int] = set()

    async def play(channel: Channel, req: Request) -> None:
        how = play_of[req.vbucket]
        if how == "state" and req.vbucket in asked:
            how = "refuse"
        asked.add(req.vbucket)
        if how == "refuse":
            await channel.send(
                frame(STREAM_REQ, magic=RES, vbucket=NOT_MY_VBUCKET, opaque=req.opaque)
            )
            return
        o, vb = req.opaque, req.vbucket
        key = f"k{vb}".encode()
        await channel.send(
            stream_ok(req), marker(o, 1, 1, MEMORY, vb), mutation(o, 1, key, vbucket=vb)
        )
        if how == "state":
            await channel.send(stream_end(o, 2, vb))
        elif how == "ok":
            await channel.send(stream_end(o, 0, vb))

    return ScriptedUpr(play, vbuckets={0: (0xABC, 1), 1: (0xDEF, 1)})


async def open_client(
    nursery: trio.Nursery, upr: ScriptedUpr, flags: ConnectFlags = LIVE
) -> tuple[TapFront, TapClient]:
    rig = await tap_front_over_scripted(nursery, upr, noop_interval=0.1)
    backfill = 0 if flags & F.BACKFILL else None
    return rig.front, await rig.client(b"lost", flags, backfill_date=backfill, vbuckets=(0, 1))


def ends(front: TapFront) -> int:
    return sum(front.stats.stream_ends_total.values())


async def idle_after_ends(client: TapClient, front: TapFront, count: int) -> list[TapEvent]:
    """What the client gets up to a NOOP sent once ``count`` streams ended; then the
    next event must be another NOOP: the connection is open and idle, not closed."""
    events = await client.collect(lambda e: isinstance(e, TapNoop) and ends(front) >= count)
    assert events and isinstance(events[-1], TapNoop), events  # not closed
    assert isinstance(await client.next_event(), TapNoop)
    return events


@pytest.mark.parametrize(("first", "second"), [("refuse", "refuse"), ("state", "refuse")])
async def test_every_vbucket_lost_leaves_the_tap_connection_open(
    nursery: trio.Nursery, first: str, second: str
) -> None:
    upr = two_vbuckets({0: first, 1: second})
    with trio.fail_after(20):
        front, client = await open_client(nursery, upr)
        events = await idle_after_ends(client, front, 2)
        await until(lambda: upr.closed == 1)  # the upstream connection is closed
        assert upr.connections == 1  # and not reconnected
        keys = [e.key for e in events if isinstance(e, TapMutation)]
        assert keys == ([b"k0"] if first == "state" else [])
        assert front.stats.stream_ends_total[TAP_FRONT, "refused_0x07"] == 2
        # The client's close ends the session.
        await client.aclose()
        await until(lambda: not front.sessions.holds("lost"))


async def test_the_vbuckets_not_lost_go_on_streaming(nursery: trio.Nursery) -> None:
    upr = two_vbuckets({0: "refuse", 1: "live"})
    with trio.fail_after(20):
        front, client = await open_client(nursery, upr)
        events = await idle_after_ends(client, front, 1)
        assert [e.key for e in events if isinstance(e, TapMutation)] == [b"k1"]
        assert upr.closed == 0  # vbucket 1 still streams
        await client.aclose()


async def test_a_dump_that_lost_a_vbucket_still_closes_when_done(nursery: trio.Nursery) -> None:
    """2.x ``registerCursor`` skips the vbucket a dump cannot have, and the dump
    closes once the rest is acked."""
    upr = two_vbuckets({0: "refuse", 1: "ok"})
    with trio.fail_after(20):
        _, client = await open_client(nursery, upr, F.LIST_VBUCKETS | F.DUMP | F.SUPPORT_ACK)
        events = await client.collect()  # up to the close
        assert [e.key for e in events if isinstance(e, TapMutation)] == [b"k1"]


async def test_streams_served_to_their_end_close_the_connection(nursery: trio.Nursery) -> None:
    """Nothing was lost: the upstream served every stream to its end."""
    upr = two_vbuckets({0: "ok", 1: "ok"})
    with trio.fail_after(20):
        _, client = await open_client(nursery, upr)
        events = await client.collect()  # up to the close
        assert sorted(e.key for e in events if isinstance(e, TapMutation)) == [b"k0", b"k1"]
