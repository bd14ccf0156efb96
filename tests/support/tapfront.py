"""The TAP front in tests: a front on a free port over a reference node, the store
the TAP tests fill, the state a TAP client builds from what it receives, and the
checks of a TAP stream's shape (backfill and checkpoint brackets)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapEvent,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapVbucketSet,
)
from gateway.fronts.tap.server import TapFront, TapFrontConfig
from gateway.metrics.figures import GatewayStats
from gateway.node.store import Store
from tests.support.tap_client import TapClient, is_opaque, wants_ack

VBUCKETS = 4
"""The vbuckets of ``filled_store`` and of what ``catch_up`` compares."""
Entry = tuple[bytes, int, int, int]
"""(value, cas, rev_seqno, flags as stored) of a live key."""


async def start_front(
    nursery: trio.Nursery, node_port: int, *, state_dir: Path | None = None, **config: Any
) -> tuple[TapFront, int]:
    config.setdefault("backoff", 0.05)
    config.setdefault("noop_interval", 0.5)
    front = TapFront(
        TapFrontConfig(("127.0.0.1", 0), ("127.0.0.1", node_port), state_dir=state_dir, **config),
        GatewayStats(),
    )
    port = await nursery.start(front.serve)
    return front, port


def filled_store(**kwargs: object) -> Store:
    """Writes, overwrites and deletes in every vbucket."""
    store = Store(VBUCKETS, **kwargs)  # type: ignore[arg-type]
    now = time.time()
    for vb in range(VBUCKETS):
        for i in range(30):
            store.set(vb, b"key-%d" % i, b"value-%d-%d" % (vb, i), flags=0x01020304 + i, now=now)
        for i in range(0, 30, 3):
            store.set(vb, b"key-%d" % i, b"again-%d" % i, now=now)
        for i in range(0, 30, 7):
            store.delete(vb, b"key-%d" % i, now=now)
    return store


def swapped(flags: int) -> int:
    return int.from_bytes(flags.to_bytes(4, "big"), "little")


@dataclass
class Replica:
    """What a 2.x TAP replica would hold after applying the events, per (vbucket, key)."""

    items: dict[tuple[int, bytes], Entry] = field(default_factory=dict)
    states: dict[int, int] = field(default_factory=dict)
    resets: list[int] = field(default_factory=list)
    mutations: int = 0
    deletes: int = 0

    def apply(self, events: list[TapEvent]) -> None:
        for event in events:
            if isinstance(event, TapMutation):
                self.mutations += 1
                flags = event.flags
                if not event.tap_flags & TapFlags.NETWORK_BYTE_ORDER:
                    flags = swapped(flags)
                rev = event.rev_seqno or 0
                self.items[event.vbucket, event.key] = (event.value, event.cas, rev, flags)
            elif isinstance(event, TapDelete):
                self.deletes += 1
                self.items.pop((event.vbucket, event.key), None)
            elif isinstance(event, TapOpaque):
                if event.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM:
                    self.resets.append(event.vbucket)
                    for key in [k for k in self.items if k[0] == event.vbucket]:
                        del self.items[key]
            elif isinstance(event, TapVbucketSet):
                self.states[event.vbucket] = event.state


def node_state(store: Any, vbuckets: list[int] | range) -> dict[tuple[int, bytes], Entry]:
    """The live items of ``vbuckets`` in a reference node's store."""
    out: dict[tuple[int, bytes], Entry] = {}
    for vb in vbuckets:
        for item in store.items_since(vb, 0, None, 1 << 30):
            if not item.deleted:
                out[vb, item.key] = (item.value, item.cas, item.rev_seqno, item.flags)
    return out


def closes(events: list[TapEvent]) -> int:
    return sum(
        isinstance(e, TapOpaque) and e.opaque_code == OpaqueCode.CLOSE_BACKFILL for e in events
    )


async def catch_up(client: TapClient, replica: Replica, store: object) -> list[TapEvent]:
    """Read batches (each ends with an ack request) until the replica equals the node
    (its vbuckets 0-3)."""
    events: list[TapEvent] = []
    while replica.items != node_state(store, range(VBUCKETS)):
        batch = await client.collect(wants_ack)
        assert batch, "the front closed the connection"
        replica.apply(batch)
        events.extend(batch)
    return events


def check_brackets(events: list[TapEvent], *, checkpoints: bool = True) -> None:
    """Checkpoints open and close per vbucket, items only inside one or a backfill;
    without ``checkpoints`` (no CHECKPOINT flag), no checkpoint message and items
    outside a backfill alone."""
    open_bracket: dict[int, int | str] = {}
    for event in events:
        if isinstance(event, TapCheckpointStart | TapCheckpointEnd):
            assert checkpoints, event
        if isinstance(event, TapCheckpointStart):
            assert event.vbucket not in open_bracket
            open_bracket[event.vbucket] = event.checkpoint_id
        elif isinstance(event, TapCheckpointEnd):
            assert open_bracket.pop(event.vbucket) == event.checkpoint_id
        elif (
            isinstance(event, TapOpaque) and event.opaque_code == OpaqueCode.INITIAL_VBUCKET_STREAM
        ):
            assert event.vbucket not in open_bracket
            open_bracket[event.vbucket] = "backfill"
        elif is_opaque(event, OpaqueCode.CLOSE_BACKFILL):
            assert open_bracket.pop(event.vbucket) == "backfill"
        elif isinstance(event, TapMutation | TapDelete):
            assert event.vbucket in open_bracket or not checkpoints, event
