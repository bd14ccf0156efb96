"""TAP clients served through the TAP front from a UPR reference node.

Live items come inside CHECKPOINT_START/END only for a client with the
CHECKPOINT flag (ep-engine 2.5.1 src/tapconnection.cc ``supportCheckpointSync_``,
set by ``TapProducer::evaluateFlags`` for that flag alone), alone otherwise.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import trio

from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapCheckpointStart,
    TapEvent,
    TapMutation,
)
from gateway.tools.load import run_load
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import (
    STREAM_TYPES,
    TapClient,
    is_opaque,
    wants_ack,
)
from tests.support.tapfront import (
    Replica,
    catch_up,
    check_brackets,
    closes,
    filled_store,
    node_state,
)

F = ConnectFlags
VBUCKETS = 4


async def read_until(client: TapClient, done: callable, replica: Replica) -> list[TapEvent]:  # type: ignore[valid-type]
    """Collect (acking what asks for it) until ``done(all events so far)``."""
    events: list[TapEvent] = []
    while not done(events):
        batch = await client.collect(lambda e: isinstance(e, STREAM_TYPES))
        assert batch, "the front closed the connection"
        events.extend(batch)
        replica.apply(batch)
    return events


@pytest.mark.parametrize("checkpoint", [True, False])
async def test_backfill_then_live_changes_match_the_node(
    nursery: trio.Nursery, checkpoint: bool
) -> None:
    """With the CHECKPOINT flag the stream opens with OPAQUE(ENABLE_CHECKPOINT_SYNC)
    after OPAQUE(ENABLE_AUTO_NACK) and live items come in checkpoints; without
    it, neither (2.5.1 tapconnection.cc ``evaluateFlags``, ``nextFgFetched_UNLOCKED``)."""
    store = filled_store()
    rig = await tap_front_over_node(nursery, store)
    replica = Replica()
    flags = F.BACKFILL | F.SUPPORT_ACK | (F.CHECKPOINT if checkpoint else F(0))
    with trio.fail_after(20):
        client = await rig.client(b"bf", flags, backfill_date=0)
        events = await read_until(client, lambda ev: closes(ev) == VBUCKETS, replica)
        opening = [OpaqueCode.ENABLE_AUTO_NACK]
        if checkpoint:
            opening.append(OpaqueCode.ENABLE_CHECKPOINT_SYNC)
        assert [e.opaque_code for e in events[: len(opening)]] == opening  # type: ignore[union-attr]
        assert not is_opaque(events[len(opening)], OpaqueCode.ENABLE_CHECKPOINT_SYNC)
        assert sorted(replica.resets) == list(range(VBUCKETS))
        assert replica.items == node_state(store, range(VBUCKETS))
        now = time.time()
        for vb in range(VBUCKETS):
            store.set(vb, b"live-%d" % vb, b"new", now=now)
            store.delete(vb, b"key-1", now=now)
        live = await catch_up(client, replica, store)
        check_brackets(events + live, checkpoints=checkpoint)
        assert any(isinstance(e, TapCheckpointStart) for e in live) is checkpoint
        assert any(isinstance(e, TapMutation) for e in live)
        await client.aclose()


async def test_live_checkpoints_wrap_items_under_concurrent_load(nursery: trio.Nursery) -> None:
    rig = await tap_front_over_node(nursery, node={"vbuckets": VBUCKETS})
    replica = Replica()
    with trio.fail_after(30):
        client = await rig.client(
            b"load", F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT, backfill_date=0
        )
        events: list[TapEvent] = []
        async with trio.open_nursery() as writers:
            writers.start_soon(
                partial(run_load, "127.0.0.1", rig.upstream_port, items=3000, delete_fraction=0.2)
            )
            while closes(events) < VBUCKETS:
                batch = await client.collect(wants_ack)
                replica.apply(batch)
                events.extend(batch)
        events += await catch_up(client, replica, rig.node.store)
        check_brackets(events)
        assert replica.mutations >= 3000
        await client.aclose()
