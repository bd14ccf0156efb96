"""Property: whatever the writes and however they interleave with a stream, a
consumer that applies the stream in order ends up with exactly the store.

Each example runs a node, writes some items, opens a stream (optionally with
a small flow-control buffer that the consumer acknowledges as it goes), then
keeps writing while the stream runs, yielding to it at random points. Writes
span several checkpoints and, with enough keys, several backfill batches.
"""

from __future__ import annotations

import time

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import upr
from gateway.node.items import ItemKind
from gateway.node.store import Store
from tests.support.upr_client import UprClient, start_node, until

Op = tuple[str, int, int]

ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "set", "delete", "yield"]), st.integers(0, 300), st.integers(0, 60)
    ),
    max_size=120,
)


def apply(store: Store, op: Op) -> None:
    kind, key_index, size = op
    key = b"key-%d" % key_index
    now = time.time()
    if kind == "set":
        store.set(0, key, bytes([key_index % 251]) * size, now=now)
    elif kind == "delete":
        item = store.lookup(0, key)
        if item is not None and not item.deleted:
            store.delete(0, key, now=now)


class Replica:
    """What a consumer holds after applying a stream, with the stream's shape checked."""

    def __init__(self) -> None:
        self.items: dict[bytes, tuple[str, bytes, int]] = {}
        self.last_seqno = 0
        self.snapshot: tuple[int, int] | None = None
        self.snapshot_keys: set[bytes] = set()

    def apply(self, event: upr.UprEvent) -> None:
        if isinstance(event, upr.SnapshotMarker):
            assert event.start_seqno > self.last_seqno
            assert event.start_seqno <= event.end_seqno
            self.snapshot, self.snapshot_keys = (event.start_seqno, event.end_seqno), set()
        elif isinstance(event, upr.Mutation | upr.Deletion):
            assert self.snapshot is not None
            assert self.snapshot[0] <= event.by_seqno <= self.snapshot[1]
            assert event.by_seqno > self.last_seqno
            assert event.key not in self.snapshot_keys
            self.snapshot_keys.add(event.key)
            self.last_seqno = event.by_seqno
            value = event.value if isinstance(event, upr.Mutation) else b""
            self.items[event.key] = (event.NAME, value, event.by_seqno)


def expected(store: Store) -> dict[bytes, tuple[str, bytes, int]]:
    return {
        it.key: (
            "MUTATION" if it.kind is ItemKind.MUTATION else "DELETION",
            it.value,
            it.by_seqno,
        )
        for it in store.items_since(0, 0)
    }


async def consume(client: UprClient, replica: Replica, buffer: int | None) -> None:
    while True:
        event = await client.receive()
        await client.answer(event)
        if event.opaque == 1:
            replica.apply(event)
        if buffer is not None and client.unacked >= buffer // 3:
            await client.ack_buffer()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    before=ops,
    during=ops,
    buffer=st.none() | st.integers(300, 4000),
    checkpoint_items=st.integers(1, 40),
    preload=st.integers(0, 700),
)
async def test_a_consumer_ends_up_with_the_store(
    before: list[Op],
    during: list[Op],
    buffer: int | None,
    checkpoint_items: int,
    preload: int,
) -> None:
    store = Store(1, checkpoint_items=checkpoint_items)
    for i in range(preload):  # enough for a backfill of several batches
        apply(store, ("set", i, 10))
    for op in before:
        apply(store, op)
    async with trio.open_nursery() as nursery:
        _, port = await start_node(nursery, store, vbuckets=1)
        client = await UprClient.connect(port)
        await client.open(b"property")
        if buffer is not None:
            await client.control("connection_buffer_size", str(buffer))
        assert isinstance(await client.stream_request(0, opaque=1), upr.StreamRequestOk)
        replica = Replica()
        nursery.start_soon(consume, client, replica, buffer)
        for op in during:
            if op[0] == "yield":
                for _ in range(op[2] % 4):
                    await trio.sleep(0)
            apply(store, op)
        with trio.fail_after(10):
            await until(lambda: replica.last_seqno == store.high_seqno(0))
        assert replica.items == expected(store)
        nursery.cancel_scope.cancel()
    await client.aclose()
