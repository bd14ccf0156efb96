"""A stream request the upstream refuses ends that vbucket's stream on the TAP front.

The upstream answers a STREAM_REQ it will not serve with an error status
(ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest``:
NOT_MY_VBUCKET for a vbucket it does not hold, such as one ns_server deleted
after a move; a dead one it still holds streams), which the codec gives as
the generic ``Response`` (adapters/upr/responses.py). The front logs it,
counts it and ends the vbucket (gateway/fronts/tap/upstream_streams.py); a
connection whose every vbucket was refused stays open and idle, as a 2.x
producer's did (test_lost_vbucket_conform.py).
"""

from __future__ import annotations

import trio

from adapters.tap import ConnectFlags, TapDelete, TapMutation, TapNoop
from gateway.metrics.figures import TAP_FRONT
from tests.support.fronts import tap_front_over_scripted
from tests.support.raw_dcp import RES, STREAM_REQ, frame
from tests.support.scripted_upr import Channel, Request, ScriptedUpr
from tests.support.tap_client import TapClient, connect_event

F = ConnectFlags
NOT_MY_VBUCKET = 0x07


async def test_a_refused_vbucket_ends_and_the_connection_stays(nursery: trio.Nursery) -> None:
    async def refuse(channel: Channel, req: Request) -> None:
        await channel.send(frame(STREAM_REQ, magic=RES, vbucket=NOT_MY_VBUCKET, opaque=req.opaque))

    upr = ScriptedUpr(refuse, vbuckets={2: (0xABC, 5)})
    rig = await tap_front_over_scripted(nursery, upr, noop_interval=0.1)
    connect = connect_event(
        b"refused", F.LIST_VBUCKETS | F.BACKFILL | F.SUPPORT_ACK, backfill_date=0, vbuckets=(2,)
    )
    with trio.fail_after(20):
        client = await TapClient.open(rig.port, connect)
        ends = rig.front.stats.stream_ends_total
        # acking as asked, up to a NOOP once the stream was refused: open, idle
        events = await client.collect(
            lambda e: isinstance(e, TapNoop) and ends[TAP_FRONT, "refused_0x07"] == 1
        )
        assert isinstance(events[-1], TapNoop)
        await client.aclose()
    assert not [e for e in events if isinstance(e, TapMutation | TapDelete)]
