"""A stream request the upstream refuses ends that vbucket's stream on the TAP front.

The upstream answers a STREAM_REQ it will not serve with an error status
(ep-engine 3.0 src/upr-producer.cc ``UprProducer::streamRequest``:
NOT_MY_VBUCKET for a vbucket it does not hold; the reference node likewise
for a dead one,
``check_request`` in gateway/node/upr_streams.py), which the codec gives as
the generic ``Response`` (adapters/upr/responses.py). The front logs it,
counts it and ends the vbucket (gateway/fronts/tap/upstream_streams.py); a
connection whose every vbucket was refused stays open and idle, as a 2.x
producer's did (test_lost_vbucket_conform.py).
"""

from __future__ import annotations

import time

import trio

from adapters.mcbp.constants import VBucketState
from adapters.tap import ConnectFlags, TapDelete, TapMutation, TapNoop
from gateway.metrics.figures import TAP_FRONT
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import TapClient, connect_event
from tests.support.tapfront import filled_store

F = ConnectFlags


async def test_a_refused_vbucket_ends_and_the_others_stream(nursery: trio.Nursery) -> None:
    store = filled_store()
    store.set_state(2, VBucketState.DEAD, now=time.time())  # replicas stream
    rig = await tap_front_over_node(nursery, store, noop_interval=0.1)
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
