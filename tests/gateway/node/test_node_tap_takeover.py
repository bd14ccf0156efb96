"""TAP takeover, and a vbucket move from one node to another over TAP."""

from __future__ import annotations

import time

import pytest
import trio

from adapters.mcbp import Magic
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapDelete,
    TapEvent,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapVbucketSet,
    decode_frame,
    encode,
)
from gateway.node.items import Item, StoreError, VBucketState
from gateway.node.store import Store
from tests.support.raw_dcp import packet_of
from tests.support.tap_client import TapClient, connect_event, start_node

F = ConnectFlags
VBUCKETS = 4
MOVE = F.BACKFILL | F.SUPPORT_ACK | F.LIST_VBUCKETS | F.TAKEOVER_VBUCKETS | F.CHECKPOINT


def filled_store(**kwargs: object) -> Store:
    store = Store(VBUCKETS, **kwargs)  # type: ignore[arg-type]
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(25):
            store.set(
                vb,
                b"k-%d" % i,
                b"v-%d-%d" % (vb, i),
                flags=i,
                expiration=int(now) + 3600 if i % 3 else 0,
                now=now,
            )
        for i in range(0, 25, 4):
            store.delete(vb, b"k-%d" % i, now=now)
    return store


def concerning(events: list[TapEvent], vb: int) -> list[TapEvent]:
    return [e for e in events if getattr(e, "vbucket", None) == vb and not _connection_level(e)]


def _connection_level(event: TapEvent) -> bool:
    return isinstance(event, TapOpaque) and event.opaque_code in (
        OpaqueCode.ENABLE_AUTO_NACK,
        OpaqueCode.ENABLE_CHECKPOINT_SYNC,
    )


def contents(store: Store, vb: int) -> dict[bytes, tuple[object, ...]]:
    """Per key what replication must carry over (seqnos are each node's own)."""

    def row(it: Item) -> tuple[object, ...]:
        if it.deleted:  # a TAP DELETE carries no flags
            return (True, it.cas, it.rev_seqno)
        return (False, it.value, it.cas, it.rev_seqno, it.flags, it.expiration)

    return {it.key: row(it) for it in store.items_since(vb, 0)}


async def test_takeover_of_two_vbuckets(nursery: trio.Nursery) -> None:
    store = filled_store()
    _, port = await start_node(nursery, store, vbuckets=VBUCKETS)
    connect = connect_event(b"tko", MOVE, backfill_date=0, vbuckets=(1, 2))
    with trio.fail_after(5):
        async with await TapClient.open(port, connect) as client:
            events = await client.collect()  # acking everything, until the node closes
    for vb in (1, 2):
        mine = concerning(events, vb)
        first = mine[0]
        assert isinstance(first, TapVbucketSet) and first.state is VBucketState.PENDING
        last = mine[-1]
        assert isinstance(last, TapVbucketSet) and last.state is VBucketState.ACTIVE
        assert last.tap_flags & TapFlags.ACK
        items = [e for e in mine if isinstance(e, TapMutation | TapDelete)]
        assert [e.key for e in items] == [it.key for it in store.items_since(vb, 0)]
        assert store.state(vb) is VBucketState.DEAD
    assert store.state(0) is store.state(3) is VBucketState.ACTIVE
    assert not concerning(events, 0)


class Pump:
    """What 2.x's ebucketmigrator did: relay a source's TAP stream and the acks."""

    def __init__(self, source: TapClient, destination: TapClient) -> None:
        self.source = source
        self.destination = destination
        self.relayed: list[TapEvent] = []
        self.acks = 0

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._acks_back)
            while (frame := await self.source.next_frame()) is not None:
                self.relayed.append(decode_frame(frame))
                await self.destination.send(packet_of(frame))
            # The source closed once every ack was in; confirm the destination
            # applied everything before letting go of it.
            close = TapOpaque(OpaqueCode.CLOSE_TAP_STREAM, opaque=0xC105E, tap_flags=TapFlags.ACK)
            self.closing = trio.Event()
            await self.destination.send(encode(close))
            await self.closing.wait()
            nursery.cancel_scope.cancel()

    async def _acks_back(self) -> None:
        while (frame := await self.destination.next_frame()) is not None:
            assert frame.magic == Magic.RESPONSE and frame.vbucket_or_status == 0, frame
            if frame.opaque == 0xC105E:
                self.closing.set()
                continue
            self.acks += 1
            if not self.source.closed:
                await self.source.send(packet_of(frame))


@pytest.mark.parametrize("history", [1000, 2], ids=["checkpoint-resume", "backfill"])
async def test_vbucket_move_node_to_node_while_writes_continue(
    nursery: trio.Nursery, history: int
) -> None:
    # With a short checkpoint history the source cannot resume the
    # destination's checkpoints: it backfills, and the destination's stale
    # copy is reset first.
    source = filled_store(checkpoint_items=6, checkpoint_history=history)
    destination = Store(VBUCKETS, initial_state=VBucketState.REPLICA)
    if history == 2:
        destination.apply_mutation(
            0, b"stale", b"x", flags=0, expiration=0, cas=1, rev_seqno=1, now=time.time()
        )
    _, port_a = await start_node(nursery, source, vbuckets=VBUCKETS)
    _, port_b = await start_node(nursery, destination, vbuckets=VBUCKETS)
    moving = (0, 3)
    last_closed = tuple(
        (vb, destination.vbucket_stats(vb).last_closed_checkpoint_id) for vb in moving
    )
    connect = connect_event(
        b"move", MOVE, backfill_date=0, vbuckets=moving, checkpoints=last_closed
    )
    written: list[bytes] = []

    async def writer() -> None:
        # Keeps writing into the moving vbuckets until they stop being active here.
        for i in range(10_000):
            try:
                source.set(moving[i % 2], b"w-%d" % i, b"during-%d" % i, now=time.time())
            except StoreError:
                return
            written.append(b"w-%d" % i)
            await trio.sleep(0)

    with trio.fail_after(10):
        pump = Pump(await TapClient.open(port_a, connect), await TapClient.open(port_b))
        async with trio.open_nursery() as inner:
            inner.start_soon(writer)
            inner.start_soon(pump.run)
    assert written  # some writes raced the move
    for vb in moving:
        assert source.state(vb) is VBucketState.DEAD
        assert destination.state(vb) is VBucketState.ACTIVE
        assert contents(destination, vb) == contents(source, vb)
    assert pump.acks and sum(isinstance(e, TapVbucketSet) for e in pump.relayed) == 4
    reset = [
        e
        for e in pump.relayed
        if isinstance(e, TapOpaque) and e.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM
    ]
    assert len(reset) == (2 if history == 2 else 0)
    # Untouched vbuckets stay as they were on both sides.
    assert destination.state(1) is VBucketState.REPLICA and not contents(destination, 1)
    assert source.state(1) is VBucketState.ACTIVE
