"""Scale run (``-m slow``): 1024 vbuckets, a dozen TAP clients of mixed kinds, writes
throughout; every client ends with the node's state."""

from __future__ import annotations

import pytest
import trio

from adapters.tap import ConnectFlags, TapEvent
from gateway.node.store import Store
from gateway.tools.load import run_load
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import wants_ack
from tests.support.tapfront import Entry, Replica, check_brackets, node_state

F = ConnectFlags
VBUCKETS = 1024
CLIENTS = 12
FLAG_SETS = (
    F.BACKFILL | F.SUPPORT_ACK,
    F.BACKFILL,
    F.BACKFILL | F.SUPPORT_ACK | F.KEYS_ONLY,
    F.BACKFILL | F.SUPPORT_ACK | F.CHECKPOINT | F.REGISTERED_CLIENT,
)


def comparable(items: dict[tuple[int, bytes], Entry], flags: ConnectFlags) -> object:
    """What a client of ``flags`` can be compared on (keys only: no values)."""
    if flags & F.KEYS_ONLY:
        return {key: entry[1:] for key, entry in items.items()}
    return items


@pytest.mark.slow
async def test_many_clients_over_1024_vbuckets_under_load(nursery: trio.Nursery) -> None:
    store = Store(VBUCKETS)
    rig = await tap_front_over_node(
        nursery, store, node={"vbuckets": VBUCKETS}, buffer_size=256 * 1024
    )
    await run_load("127.0.0.1", rig.upstream_port, items=20_000, value_size=64)
    replicas = [Replica() for _ in range(CLIENTS)]
    writes_done = trio.Event()

    async def follow(index: int) -> None:
        flags = FLAG_SETS[index % len(FLAG_SETS)]
        replica = replicas[index]
        client = await rig.client(b"soak-%d" % index, flags, backfill_date=0)
        events: list[TapEvent] = []
        while True:
            event = None
            with trio.move_on_after(0.5):
                event = await client.next_event()
            if event is None:
                expected = node_state(store, range(VBUCKETS))
                if writes_done.is_set() and comparable(replica.items, flags) == comparable(
                    expected, flags
                ):
                    break
                continue
            events.append(event)
            replica.apply([event])
            if wants_ack(event):
                await client.ack(event)  # type: ignore[arg-type]
        # 2.5.1 tapconnection.cc: checkpoint messages only with the CHECKPOINT flag.
        check_brackets(events, checkpoints=bool(flags & F.CHECKPOINT))
        await client.aclose()

    with trio.fail_after(300):
        async with trio.open_nursery() as clients:
            for index in range(CLIENTS):
                clients.start_soon(follow, index)
            await run_load(
                "127.0.0.1", rig.upstream_port, items=30_000, value_size=64, delete_fraction=0.2,
                seed=3, key_prefix="more", rate=10_000,
            )  # fmt: skip
            writes_done.set()
    assert all(stats.acks_pending == 0 for stats in rig.front.stats.active("tap_front"))
