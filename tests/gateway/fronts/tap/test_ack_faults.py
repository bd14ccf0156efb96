"""TAP acks that go wrong, against the TAP front over a reference node.

What each follows, ep-engine 2.5.1 src/tapconnection.cc ``TapProducer::processAck``
(reached through src/ep_engine.cc ``processTapAck``, which only checks the
connection is live):

- a nack with EBUSY or ETMPFAIL suspends the connection for the backoff period
  (``suspendedConnection_UNLOCKED``) and sends the message again; the
  connection stays;
- a nack with any other status (ENOMEM among them) disconnects: a registered
  client that reconnects under its name resumes from what it acked, so what
  it had not acked is sent again (``TapProducer::rollback`` put the ack log
  back in the queue; the front resumes from the acked position);
- an ack names a sequence number and covers every message before it; one for
  a number not in the ack log (acked already, out of order, or never sent)
  is logged ("Explicit ack of nonexisting entry") and changes nothing: the
  connection stays;
- with no acks the ack window fills (``windowIsFull``: ack window size x ack
  interval messages) and the producer sends nothing more until an ack comes,
  however long that takes: only a disconnected connection expires
  (src/tapconnmap.cc ``getExpiredConnections_UNLOCKED``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from adapters.mcbp import Status
from adapters.tap import ConnectFlags, TapEvent, TapMutation, TapOpcode, TapResponse, encode
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import (
    VBUCKETS,
    HoldingClient,
    mutation_keys,
    resets,
    versions_in_order,
    write_keys,
)
from tests.support.classic_tap import classic_reply
from tests.support.tap_client import (
    STREAM_TYPES,
    TapClient,
    connect_event,
    start_node,
    until,
    wants_ack,
)
from tests.support.tapfront import Replica, catch_up, check_brackets, node_state, start_front

F = ConnectFlags
FLAGS = F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT


async def _front(nursery: trio.Nursery, store: Store, **config: object) -> tuple[object, int]:
    _, node_port = await start_node(nursery, store)
    config.setdefault("max_unacked", 100)
    config.setdefault("ack_interval", 20)
    return await start_front(nursery, node_port, **config)


async def _held(client: HoldingClient, session: object) -> None:
    """Until the front stopped on the full window, the client holding its acks."""
    await client.wait_for(lambda: client.holding)
    await until(lambda: not session.producer.can_send)  # type: ignore[attr-defined]
    await client.wait_for(lambda: client.held)  # (read, maybe after the window filled)


def _check_complete(events: list[TapEvent], keys: list[bytes]) -> None:
    """Every key at least once, in order per key, the brackets whole."""
    assert set(mutation_keys(events)) == set(keys)
    versions_in_order(events)
    check_brackets(events)


async def test_a_tmpfail_nack_resends_and_keeps_the_connection(nursery: trio.Nursery) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"tmp", 1000)
    front, port = await _front(nursery, store, backoff=0.05)
    with trio.fail_after(30):
        tap = await TapClient.open(port, connect_event(b"tmp", FLAGS, backfill_date=0))
        client = HoldingClient(tap, hold_at=100)
        nursery.start_soon(client.run)
        await until(lambda: "tmp" in front.sessions)
        session = front.sessions.get("tmp")
        await _held(client, session)
        # Everything before the last request acked, the last one refused for now
        # (in one write: no ack of a later message overtakes the nack).
        nacked = client.held.pop()
        before = len(client.events)
        await client.release(
            b"".join(classic_reply(frame) for frame in client.held)
            + classic_reply(nacked, Status.TEMPORARY_FAILURE, b"queue full")
        )
        # Sent again, after the backoff, and the stream goes on to its end.
        resent = lambda: any(e.opaque == nacked.opaque for e in client.events[before:])  # noqa: E731
        await client.wait_for(resent)
        await client.wait_for(lambda: set(mutation_keys(client.events)) == set(keys))
        assert front.sessions.get("tmp") is session
        assert session.producer.nacks_total == 1
        # The nack acked everything before it: none of that comes again.
        after = [e for e in client.events[before:] if isinstance(e, STREAM_TYPES)]
        assert min(e.opaque for e in after) == nacked.opaque  # type: ignore[union-attr]
    _check_complete(client.events, keys)
    assert sorted(resets(client.events)) == list(range(VBUCKETS))


async def test_an_enomem_nack_closes_and_a_registered_client_resumes_from_its_acks(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"nomem", 1000)
    front, port = await _front(nursery, store, state_dir=tmp_path)
    flags = FLAGS | F.REGISTERED_CLIENT
    with trio.fail_after(30):
        tap = await TapClient.open(port, connect_event(b"nomem", flags, backfill_date=0))
        client = HoldingClient(tap, hold_at=300)
        nursery.start_soon(client.run)
        await until(lambda: "nomem" in front.sessions)
        await _held(client, front.sessions.get("nomem"))
        refused = client.held[0]
        await client.send(classic_reply(refused, Status.NO_MEMORY, b"out of memory"))
        await client.wait_for(lambda: client.closed)
        await until(lambda: "nomem" not in front.sessions)
        assert front.stats.protocol_errors_total["tap_front", "refused_ack"] == 1
        unacked = client.events[[e.opaque for e in client.events].index(refused.opaque) :]
        first = client.events
        acked = set(front.registry.positions("nomem") or {})
        assert acked  # some vbuckets have an acked position to resume from
        second = await TapClient.open(port, connect_event(b"nomem", flags, backfill_date=0))
        replica = Replica()
        replica.apply(first)
        resumed = await catch_up(second, replica, store)
        await second.aclose()
    # A resume where a position was acked (a vbucket never reached backfills).
    assert not set(resets(resumed)) & acked
    # What was not acked comes again (at least once), and nothing is missing.
    sent_again = set(mutation_keys(resumed))
    assert {e.key for e in unacked if isinstance(e, TapMutation)} <= sent_again
    _check_complete(first + resumed, keys)
    assert replica.items == node_state(store, range(VBUCKETS))


async def _out_of_order(nursery: trio.Nursery, name: bytes, first: bytes, stray: int) -> None:
    """Hold acks, then send ``first`` and the last held request's ack before an
    earlier one's (which the last already covered), that one twice: the stream
    goes on to its end with neither a gap nor a duplicate."""
    store = Store(VBUCKETS)
    keys = write_keys(store, name, 600)
    front, port = await _front(nursery, store)
    with trio.fail_after(30):
        tap = await TapClient.open(port, connect_event(name, FLAGS, backfill_date=0))
        client = HoldingClient(tap, hold_at=100)
        nursery.start_soon(client.run)
        await until(lambda: name.decode() in front.sessions)
        session = front.sessions.get(name.decode())
        await _held(client, session)
        held = client.held
        assert len(held) >= 2
        await client.release(
            first + classic_reply(held[-1]) + classic_reply(held[0]) + classic_reply(held[0])
        )
        await client.wait_for(lambda: client.mutations >= 600)
        assert front.sessions.get(name.decode()) is session, "an ack closed the connection"
        assert not front.stats.protocol_errors_total["tap_front", "refused_ack"]
        # Counted, and logged once per connection (a client may send many).
        await until(lambda: front.stats.protocol_errors_total["tap_front", "stray_ack"] == stray)
    assert sorted(mutation_keys(client.events)) == sorted(keys)  # no gap, no duplicate
    _check_complete(client.events, keys)


async def test_acks_out_of_order_and_late_change_nothing(nursery: trio.Nursery) -> None:
    await _out_of_order(nursery, b"odd", b"", stray=0)


async def test_an_ack_for_a_number_never_sent_is_ignored(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    stray = encode(TapResponse(TapOpcode.MUTATION, 0x7FFF_FFFF, 0))
    await _out_of_order(nursery, b"stray", stray + stray, stray=2)
    said = [r for r in caplog.records if "never sent" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"  # once, though sent twice


async def test_a_client_that_never_acks_fills_the_window_and_nothing_more(
    nursery: trio.Nursery,
) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"mute", 2000, size=1000)
    front, port = await _front(nursery, store, buffer_size=256 * 1024, noop_interval=0.05)
    with trio.fail_after(30):
        tap = await TapClient.open(port, connect_event(b"mute", FLAGS, backfill_date=0))
        client = HoldingClient(tap, hold_at=1)
        nursery.start_soon(client.run)
        await until(lambda: "mute" in front.sessions)
        session = front.sessions.get("mute")
        await _held(client, session)
        # Idle long enough for several NOOPs: still connected, still bounded.
        noops = session.peer.last_send
        await until(lambda: session.peer.last_send > noops + 0.2)
        assert front.sessions.get("mute") is session
        assert session.producer.unacked == 100
        assert client.mutations <= 100
        # The upstream stops at its buffer: at most one message past it.
        assert session.stats.unacked_bytes <= 256 * 1024 + 1100
        await client.release()
        await client.wait_for(lambda: client.mutations >= 2000)
    _check_complete(client.events, keys)
    assert len(mutation_keys(client.events)) == 2000
    assert [e for e in client.events if wants_ack(e)]
