"""A TAP client that stops reading, beside one that reads, on one TAP front.

A 2.x producer whose client stopped reading stopped too: memcached 2.5.1
daemon/memcached.c ``conn_ship_log`` only asks the engine for the next TAP
message once the previous write went out, so a full socket holds the stream,
and other connections are served by their own worker state. The front must do
the same end to end: the stalled client's upstream UPR stream stops at its
flow-control buffer (the upstream is paced, nothing piles up in the gateway
past its socket outbox) while the other client gets every item, backfill and
live; once the stalled one reads again it gets every item too.
"""

from __future__ import annotations

import socket

import trio

from adapters.tap import ConnectFlags, TapEvent, TapMutation, encode
from gateway.node.store import Store
from tests.gateway.fronts.tap.faults import (
    VBUCKETS,
    HoldingClient,
    mutation_keys,
    versions_in_order,
    write_keys,
)
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import TapClient, connect_event, until
from tests.support.tapfront import check_brackets

F = ConnectFlags
BUFFER = 1024 * 1024
ITEMS = 6000
VALUE = 4000
"""24 MB to stream: several times the upstream buffer, outbox and socket buffers."""


async def test_a_client_that_stops_reading_paces_its_upstream_only(
    nursery: trio.Nursery,
) -> None:
    store = Store(VBUCKETS)
    keys = write_keys(store, b"big", ITEMS, size=VALUE)
    rig = await tap_front_over_node(nursery, store, buffer_size=BUFFER)
    with trio.fail_after(60):
        stalled = await TapClient.open(rig.port)
        # A fixed receive buffer: the kernel would otherwise grow it and take in
        # what is meant to stall.
        assert isinstance(stalled.stream, trio.SocketStream)
        stalled.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        await stalled.send(encode(connect_event(b"stalled", F.BACKFILL, backfill_date=0)))
        await until(lambda: "stalled" in rig.front.sessions)
        session = rig.front.sessions.get("stalled")
        # The kernel's buffers full, then the outbox: the pump waits on the socket.
        conn = session.conn
        await until(lambda: conn.outbox_bytes >= conn.max_outbox_bytes)
        # The upstream stopped at its buffer (at most one message past it).
        assert session.stats.unacked_bytes <= BUFFER + VALUE + 200
        assert conn.peak_outbox_bytes <= conn.max_outbox_bytes + BUFFER
        stalled_sent = session.stats.items_sent["mutation"]
        assert stalled_sent < ITEMS // 2

        # Another client meanwhile: its backfill, then a live write, all of it.
        reader_tap = await rig.client(b"reader", F.BACKFILL | F.SUPPORT_ACK, backfill_date=0)
        reader = HoldingClient(reader_tap)
        nursery.start_soon(reader.run)
        await reader.wait_for(lambda: reader.mutations >= ITEMS)
        live = write_keys(store, b"live", 8)
        await reader.wait_for(lambda: set(live) <= set(mutation_keys(reader.events)))
        assert session.stats.items_sent["mutation"] == stalled_sent  # still stalled

        # The stalled client reads again: everything, in order per key.
        events: list[TapEvent] = []
        while not set(keys + live) <= {e.key for e in events if isinstance(e, TapMutation)}:
            event = await stalled.next_event()
            assert event is not None, "the front closed the stalled connection"
            events.append(event)
        await stalled.aclose()
    for got in (events, reader.events):
        assert sorted(mutation_keys(got)) == sorted(keys + live)  # no gap, no duplicate
        versions_in_order(got)
        # Neither set the CHECKPOINT flag: live items alone (2.5.1 tapconnection.cc
        # ``supportCheckpointSync_``).
        check_brackets(got, checkpoints=False)
