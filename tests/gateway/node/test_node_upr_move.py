"""A vbucket move between two nodes over UPR, with this test as the orchestrator.

The relay plays ns_server's part (the ebucketmigrator of 2.x): it opens a
consumer connection on the destination B and a producer connection on the
source A under one name, asks B to ADD_STREAM, and from then on forwards
every packet unchanged: B's STREAM_REQ, acks and replies to A, A's responses
and stream to B. Only the answers to its own requests stay with it.
"""

from __future__ import annotations

import time

import pytest
import trio

from adapters import upr
from adapters.mcbp import Status
from gateway.node import upr_consumer
from gateway.node.items import Item, VBucketState
from gateway.node.store import Store
from tests.support.raw_dcp import packet_of
from tests.support.upr_client import UprClient, start_node, until

VB = 1
NAME = b"replication:a->b"


class Relay:
    def __init__(self, source: UprClient, destination: UprClient) -> None:
        self.source = source
        self.destination = destination
        self.to_destination: list[upr.UprEvent] = []
        self.to_source: list[upr.UprEvent] = []
        self._waiting: dict[int, trio.MemorySendChannel[upr.UprEvent]] = {}
        self._scope = trio.CancelScope()

    @classmethod
    async def connect(cls, source_port: int, destination_port: int) -> Relay:
        source = await UprClient.connect(source_port)
        destination = await UprClient.connect(destination_port)
        assert (await source.open(NAME, upr.OpenFlags.PRODUCER)).status == Status.SUCCESS
        assert (await destination.open(NAME, 0)).status == Status.SUCCESS
        return cls(source, destination)

    async def run(self) -> None:
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, self.destination, self.source, self.to_source)
                nursery.start_soon(self._pump, self.source, self.destination, self.to_destination)

    async def stop(self) -> None:
        self._scope.cancel()
        await self.source.aclose()
        await self.destination.aclose()

    async def _pump(self, src: UprClient, dst: UprClient, seen: list[upr.UprEvent]) -> None:
        while True:
            received = await src.receive_sized()
            waiter = self._waiting.pop(received.event.opaque, None)
            if received.event.IS_RESPONSE and waiter is not None:
                await waiter.send(received.event)
                continue
            seen.append(received.event)
            await dst.send_raw(packet_of(received.frame))

    async def request(self, client: UprClient, event: upr.UprRequest) -> upr.UprEvent:
        send, receive = trio.open_memory_channel[upr.UprEvent](1)
        self._waiting[event.opaque] = send
        await client.send(event)
        return await receive.receive()

    async def add_stream(self, vbucket: int, flags: int = 0) -> upr.UprEvent:
        event = upr.AddStream(
            upr.StreamFlags(flags), opaque=self.destination.next_opaque(), vbucket=vbucket
        )
        return await self.request(self.destination, event)

    async def close_stream(self, vbucket: int) -> None:
        for client in (self.destination, self.source):
            reply = await self.request(client, upr.CloseStream(client.next_opaque(), vbucket))
            assert reply.status == Status.SUCCESS

    def states_sent(self) -> list[VBucketState]:
        return [e.state for e in self.to_destination if isinstance(e, upr.SetVbucketState)]


def content(store: Store, vb: int) -> list[tuple[object, ...]]:
    def row(it: Item) -> tuple[object, ...]:
        # A DELETION carries no item flags (3.0 layout): tombstones compare without.
        flags = None if it.deleted else it.flags
        return (it.key, it.value, it.by_seqno, it.rev_seqno, it.cas, flags, it.expiration, it.kind)

    return [row(it) for it in store.items_since(vb, 0)]


def write(store: Store, start: int, count: int) -> None:
    """Sets, overwrites and deletes in ``VB``."""
    now = time.time()
    for i in range(start, start + count):
        store.set(VB, b"key-%d" % (i % 25), b"value %d" % i, flags=i, now=now)
        victim = store.lookup(VB, b"key-%d" % ((i + 7) % 25))
        if i % 4 == 0 and victim is not None and not victim.deleted:
            store.delete(VB, victim.key, now=now)


@pytest.mark.parametrize("buffer", [None, 1024])
async def test_vbucket_move_with_takeover(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, buffer: int | None
) -> None:
    if buffer is not None:
        # A small flow-control buffer: the move completes only if B acks right.
        monkeypatch.setattr(upr_consumer, "BUFFER_SIZE", buffer)
    source = Store(4, checkpoint_items=10)
    write(source, 0, 60)
    destination = Store(4, initial_state=VBucketState.REPLICA)
    node_a, port_a = await start_node(nursery, source)
    node_b, port_b = await start_node(nursery, destination)
    relay = await Relay.connect(port_a, port_b)
    nursery.start_soon(relay.run)

    # Replication first: B catches up while A keeps taking writes.
    added = await relay.add_stream(VB)
    assert isinstance(added, upr.AddStreamResponse) and added.status == Status.SUCCESS
    write(source, 60, 40)
    await until(lambda: destination.high_seqno(VB) == source.high_seqno(VB))
    write(source, 100, 30)
    await until(lambda: destination.high_seqno(VB) == source.high_seqno(VB))
    assert content(destination, VB) == content(source, VB)
    assert destination.state(VB) is VBucketState.REPLICA
    await relay.close_stream(VB)

    # Then the takeover, resuming from where replication left B.
    write(source, 130, 10)
    resume_at = destination.high_seqno(VB)
    added = await relay.add_stream(VB, upr.StreamFlags.TAKEOVER)
    assert isinstance(added, upr.AddStreamResponse) and added.status == Status.SUCCESS
    await until(lambda: destination.state(VB) is VBucketState.ACTIVE)
    consumer = node_b.upr.get(NAME.decode())
    await until(lambda: consumer.streams[VB].state == "dead")

    assert source.state(VB) is VBucketState.DEAD
    assert content(destination, VB) == content(source, VB)
    assert relay.states_sent() == [VBucketState.PENDING, VBucketState.ACTIVE]
    ends = [e for e in relay.to_destination if isinstance(e, upr.StreamEnd)]
    # The closed replication stream ended with its CLOSE_STREAM response.
    assert [e.reason for e in ends] == [upr.StreamEndReason.OK]
    # Both stream requests resumed; neither had to roll back.
    requests = [e for e in relay.to_source if isinstance(e, upr.StreamRequest)]
    assert [r.start_seqno for r in requests] == [0, resume_at]
    assert requests[1].vbucket_uuid == source.failover_log(VB)[0][0]
    assert requests[1].flags == upr.StreamFlags.TAKEOVER
    assert not any(isinstance(e, upr.StreamRequestRollback) for e in relay.to_destination)
    # B adopted A's history, then started its own as the new active copy.
    assert destination.failover_log(VB)[1:] == source.failover_log(VB)
    # B acknowledged flow-control bytes as it went (CONTROL announced first).
    controls = [e for e in relay.to_source if isinstance(e, upr.Control)]
    assert controls and controls[0].key == b"connection_buffer_size"
    window = node_a.upr.get(NAME.decode()).window
    assert window.buffer_size == int(controls[0].value)
    acks = [e.buffer_bytes for e in relay.to_source if isinstance(e, upr.BufferAcknowledgement)]
    assert sum(acks) == window.total_acked
    if buffer is not None:
        assert window.total_sent > 4 * buffer and len(acks) >= 4
    await relay.stop()


async def test_vbucket_move_rolls_back_a_diverged_destination(nursery: trio.Nursery) -> None:
    source = Store(4)
    write(source, 0, 50)
    destination = Store(4)
    now = time.time()
    for i in range(20):
        destination.set(VB, b"stale-%d" % i, b"from another history", now=now)
    destination.set_state(VB, VBucketState.REPLICA, now=now)
    _, port_a = await start_node(nursery, source)
    _, port_b = await start_node(nursery, destination)
    relay = await Relay.connect(port_a, port_b)
    nursery.start_soon(relay.run)

    added = await relay.add_stream(VB, upr.StreamFlags.TAKEOVER)
    assert isinstance(added, upr.AddStreamResponse) and added.status == Status.SUCCESS
    await until(lambda: destination.state(VB) is VBucketState.ACTIVE)

    rollbacks = [e for e in relay.to_destination if isinstance(e, upr.StreamRequestRollback)]
    assert [r.rollback_seqno for r in rollbacks] == [0]
    requests = [e for e in relay.to_source if isinstance(e, upr.StreamRequest)]
    assert [r.start_seqno for r in requests] == [20, 0]
    assert content(destination, VB) == content(source, VB)
    assert source.state(VB) is VBucketState.DEAD
    await relay.stop()


async def test_add_stream_refusals(nursery: trio.Nursery) -> None:
    destination = Store(4, initial_state=VBucketState.REPLICA)
    destination.set_state(2, VBucketState.ACTIVE, now=time.time())
    _, port_b = await start_node(nursery, destination)
    client = await UprClient.connect(port_b)
    assert (await client.open(b"consumer", 0)).status == Status.SUCCESS
    control = await client.receive()
    assert isinstance(control, upr.Control) and control.key == b"connection_buffer_size"

    async def add(vb: int) -> upr.UprEvent:
        return await client.request(upr.AddStream(opaque=client.next_opaque(), vbucket=vb))

    assert (await add(9)).status == Status.NOT_MY_VBUCKET
    assert (await add(2)).status == Status.NOT_MY_VBUCKET  # active: it is the source
    first = await add(0)
    assert isinstance(first, upr.AddStreamResponse) and first.status == Status.SUCCESS
    request = await client.receive()
    assert isinstance(request, upr.StreamRequest) and request.opaque == first.stream_opaque
    assert (request.vbucket, request.start_seqno) == (0, 0)
    assert (await add(0)).status == Status.KEY_EXISTS
    await client.aclose()
