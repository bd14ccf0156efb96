"""The node's TAP producer drops a client whose ack window stays full past the grace.

ep-engine 2.5.1 src/tapconnmap.cc ``TapConnMap::notifyIOThreadMain``: a
support-ack producer whose window is full (``TapProducer::windowIsFull``,
ack_window_size x ack_interval messages unacked) and whose last ack
(``processAck`` sets the expiry) is older than ``tap_ack_grace_period`` is
disconnected ("Expired and ack windows is full. Disconnecting..."); while
acks come, or while the window has room, it streams on (NOOPs included).
"""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from adapters.tap import ConnectFlags as F
from adapters.tap import TapCheckpointStart, TapMutation, TapOpaque
from gateway.node.store import Store
from tests.support.tap_client import TapClient, connect_event, start_node, until, wants_ack

WINDOW = 30


def _store(n_items: int) -> Store:
    store = Store(1)
    now = time.time()
    for i in range(n_items):
        store.set(0, b"key-%d" % i, b"value", now=now)
    return store


async def test_a_client_that_stops_acking_is_dropped_once_the_grace_ends(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    _, port = await start_node(
        nursery, _store(100), vbuckets=1, tap_ack_interval=10, tap_max_unacked=WINDOW,
        tap_ack_grace_period=0.2,
    )  # fmt: skip
    connect = connect_event(b"stuck", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
    with trio.fail_after(10):
        async with await TapClient.open(port, connect) as client:
            events = await client.collect(auto_ack=False)
    assert client.closed
    assert len(events) == WINDOW  # what the window let out, then nothing but the close
    assert any("ack window" in m and "stuck" in m for m in caplog.messages), caplog.messages


async def test_a_client_that_acks_late_but_within_the_grace_keeps_streaming(
    nursery: trio.Nursery,
) -> None:
    node, port = await start_node(
        nursery, _store(100), vbuckets=1, tap_ack_interval=10, tap_max_unacked=WINDOW,
        tap_ack_grace_period=3600,
    )  # fmt: skip
    connect = connect_event(b"late", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
    with trio.fail_after(10):
        async with await TapClient.open(port, connect) as client:
            events = [await client.message() for _ in range(WINDOW)]
            await until(lambda: not node.tap.get("late").producer.can_send)
            await client.ack(max((e for e in events if wants_ack(e)), key=lambda e: e.opaque))
            more = await client.message()
    assert isinstance(more, TapMutation)


async def test_with_control_acks_awaited_nothing_but_opaques_passes_an_unacked_opaque(
    nursery: trio.Nursery,
) -> None:
    """``tap_wait_control_acks``: ep-engine 2.5.1 src/ep_engine.cc ``doWalkTapQueue``
    sends only OPAQUE and VBUCKET_SET while an OPAQUE is unacked
    (``TapProducer::waitForOpaqueMsgAck``), src/tapconnection.cc ``getNextItem``
    no item while a checkpoint message is (``waitForCheckpointMsgAck``)."""
    store = _store(3)
    node, port = await start_node(nursery, store, vbuckets=1, tap_wait_control_acks=True)
    connect = connect_event(b"held", F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT, backfill_date=0)
    with trio.fail_after(10):
        async with await TapClient.open(port, connect) as client:
            opaques = [await client.message() for _ in range(3)]  # nack, sync, initial
            assert all(isinstance(m, TapOpaque) for m in opaques), opaques
            stream = node.tap.get("held")
            await until(lambda: stream.last_stamped == 3)
            await trio.testing.wait_all_tasks_blocked()
            assert stream.last_stamped == 3  # held: the OPAQUEs are not acked
            await client.ack(opaques[-1])  # covers all three
            items = [await client.message() for _ in range(3)]
            assert all(isinstance(m, TapMutation) for m in items), items
            close = await client.message()
            assert isinstance(close, TapOpaque)
            await client.ack(close)
            store.set(0, b"live", b"x", now=time.time())
            start = await client.message()
            assert isinstance(start, TapCheckpointStart)
            await trio.testing.wait_all_tasks_blocked()
            assert stream.last_stamped == start.opaque  # the item waits for its ack
            await client.ack(start)
            live = await client.message()
    assert isinstance(live, TapMutation) and live.key == b"live"
