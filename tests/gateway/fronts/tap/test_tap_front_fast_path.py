"""The TAP front sends the same stream whether its items take the fast path or not.

A capture directory keeps every message on the event path (captures record
events), so a front with one and a front without serve the same node's
backfill and dump by the two paths. Per vbucket, the messages must be the
same in every field but the sequence number and the ACK flag (both depend
on how the upstream's reads interleave the vbuckets and cut the batches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trio

from adapters.tap import ConnectFlags, TapEvent, TapFlags
from tests.support.fronts import tap_front_over_node
from tests.support.tap_client import STREAM_TYPES, TapClient, connect_event
from tests.support.tapfront import filled_store, start_front

F = ConnectFlags


def per_vbucket(events: list[TapEvent]) -> dict[int, list[TapEvent]]:
    out: dict[int, list[TapEvent]] = {}
    for event in events:
        if not isinstance(event, STREAM_TYPES) or not hasattr(event, "vbucket"):
            continue
        flags = TapFlags(int(event.tap_flags) & ~TapFlags.ACK.value)  # type: ignore[union-attr]
        plain = dataclasses.replace(event, opaque=0, tap_flags=flags)  # type: ignore[type-var]
        out.setdefault(event.vbucket, []).append(plain)  # type: ignore[union-attr]
    return out


async def dump(port: int, name: bytes, flags: ConnectFlags) -> list[TapEvent]:
    client = await TapClient.open(port, connect_event(name, flags, backfill_date=0))
    async with client:
        return await client.collect()


async def test_fast_path_serves_what_the_event_path_serves(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """adapters/translate/upr_to_tap_fast.py against UprToTap and the TAP codec."""
    rig = await tap_front_over_node(nursery, filled_store())
    _, event_port = await start_front(nursery, rig.upstream_port, capture_dir=tmp_path / "captures")
    for flags in (
        F.BACKFILL | F.DUMP | F.SUPPORT_ACK,
        F.BACKFILL | F.DUMP | F.KEYS_ONLY,
        F.BACKFILL | F.DUMP | F.SUPPORT_ACK | F.FIX_FLAG_BYTEORDER | F.CHECKPOINT,
    ):
        with trio.fail_after(20):
            fast = await dump(rig.port, b"fast", flags)
            slow = await dump(event_port, b"slow", flags)
        assert sum(1 for e in fast if type(e).__name__ == "TapMutation") > 50
        assert per_vbucket(fast) == per_vbucket(slow)
