"""The TAP front in tests: a front on a free port over a reference node, and the
state a TAP client builds from what it receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from adapters.tap import (
    OpaqueCode,
    TapDelete,
    TapEvent,
    TapFlags,
    TapMutation,
    TapOpaque,
    TapVbucketSet,
)
from gateway.fronts.tap.server import TapFront, TapFrontConfig
from gateway.metrics.figures import GatewayStats

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
