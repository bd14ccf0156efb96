"""Memory of stalled consumers of the UPR front: what a stream and a connection may hold.

ep-engine 3.0 bounds a DCP producer connection by the consumer's buffer
(v3.0.0 ``src/upr-producer.cc``, ``UprProducer::getNextItem`` stops while
``BufferLog::isFull``); the gateway also bounds what it queues for a socket
that does not drain (``max_outbox_bytes``), with or without flow control. A
stalled consumer therefore costs its connection at most the lesser of the two
plus one batch's framing, however many streams it opened.
"""

from __future__ import annotations

import gc
import socket
import time
import weakref
from pathlib import Path

import trio

from gateway.fronts.upr import UprFront
from gateway.fronts.upr.producer import UprConnection
from gateway.node.store import Store
from gateway.runtime.memory import release_free_memory
from tests.gateway.fronts.upr.support import (
    MAX_SEQNO,
    VBUCKETS,
    caught_up,
    open_producer,
    start_front,
    start_node,
    until,
)
from tests.support.fronts import upr_front_over_node

VALUE = b"v" * 1000
SLACK = 64 * 1024
"""One batch's framing (headers, extras, markers) and one item beyond the budget."""


def big_store(per_vbucket: int) -> Store:
    store = Store(VBUCKETS)
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(per_vbucket):
            store.set(vb, b"key-%06d" % i, VALUE, now=now)
    return store


def only_connection(front: UprFront) -> UprConnection:
    (producer,) = front.connections.values()
    return producer


async def stream_everything(port: int, window: int | None) -> object:
    client = await open_producer(port, b"stalled")
    # A fixed receive buffer: the kernel would otherwise grow it to megabytes while
    # the client reads its replies, and could take in what is meant to stall.
    assert isinstance(client.stream, trio.SocketStream)
    client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    if window is not None:
        reply = await client.control("connection_buffer_size", str(window))
        assert reply.status == 0
    for vb in range(VBUCKETS):
        reply = await client.stream_request(vb, 0, MAX_SEQNO)
        assert reply.status == 0, reply
    return client


async def test_stalled_flow_control_consumer_holds_no_more_than_its_window(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = big_store(400)
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up(30)
    window = 32 * 1024
    client = await stream_everything(rig.port, window)
    with trio.fail_after(30):
        # The consumer never acknowledges: every stream ends up waiting for room.
        await until(lambda: bool(rig.front.connections))
        producer = only_connection(rig.front)
        await until(lambda: producer.streams_waiting == VBUCKETS and not producer.window.can_send)
    assert producer.window.unacked_bytes >= window  # it did fill the window
    assert producer.window.unacked_bytes <= window + SLACK
    # Streams that found the window full read nothing at all.
    assert max(stream.peak_batch_bytes for stream in producer.streams.values()) > 0
    for stream in producer.streams.values():
        assert stream.peak_batch_bytes <= window + SLACK
    assert producer.conn.peak_outbox_bytes <= window + SLACK
    await client.aclose()  # type: ignore[attr-defined]


async def test_consumer_that_stops_reading_costs_only_the_outbox_limit(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # No flow control and a socket never read: the kernel's buffers fill
    # first (several MB on loopback), then the outbox, then every stream waits:
    # 24 MB, far more than the client reads before its last reply and the kernel
    # holds (up to 4 MB sending, 64 KiB receiving).
    store = big_store(6000)
    _, node_port = await start_node(nursery, store)
    outbox = 128 * 1024
    front, port, _ = await start_front(nursery, tmp_path, node_port, max_outbox_bytes=outbox)
    with trio.fail_after(60):
        await until(lambda: caught_up(front, store))
    client = await stream_everything(port, None)
    with trio.fail_after(60):
        await until(lambda: bool(front.connections))
        producer = only_connection(front)
        # Every stream waits, and (so that it is no passing moment) the outbox is full.
        await until(lambda: producer.streams_waiting == VBUCKETS and not producer.conn.outbox_room)
    assert producer.conn.outbox_bytes >= outbox  # it did fill the outbox
    assert producer.conn.peak_outbox_bytes <= outbox + SLACK
    for stream in producer.streams.values():
        assert stream.peak_batch_bytes <= outbox + SLACK
    assert any(stream.position < 6000 for stream in producer.streams.values())  # stalled
    await client.aclose()  # type: ignore[attr-defined]
    with trio.fail_after(30):
        await until(lambda: not front.connections)  # and the connection is let go


async def test_closed_stalled_connection_leaves_nothing_behind(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Nothing keyed by the connection outlives it: the connection and its
    # streams are freed (no cycle or cache keeps their batches alive).
    store = big_store(100)
    rig = await upr_front_over_node(nursery, tmp_path, store)
    await rig.catch_up(30)
    client = await stream_everything(rig.port, 8 * 1024)
    with trio.fail_after(30):
        await until(lambda: bool(rig.front.connections))
        await until(lambda: not only_connection(rig.front).window.can_send)
    producer = weakref.ref(only_connection(rig.front))
    streams = [weakref.ref(s) for s in only_connection(rig.front).streams.values()]
    await client.aclose()  # type: ignore[attr-defined]
    with trio.fail_after(30):
        await until(lambda: not rig.front.connections and not rig.front.stats.active("upr_front"))
    gc.collect()
    assert producer() is None
    assert all(stream() is None for stream in streams)
    if release_free_memory():  # glibc: the freed heap is given back after the close
        with trio.fail_after(30):
            await until(lambda: rig.front.trimmer.trims >= 1)
