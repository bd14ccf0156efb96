"""Streams of every connection take turns to frame disk reads (``streams.DISK_TURNS``).

Trio runs one step of every ready task before it looks at sockets and timers
again, so many backfilling streams each framing a disk batch in one round
held the loop for all of them; with turns at most ``DISK_TURNS`` do so at
once, and every stream still gets all its items.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.fronts.upr import streams
from gateway.fronts.upr.vblog import VbLog
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    filled_store,
    final_state,
    store_state,
)
from tests.support.fronts import upr_front_over_node

CONSUMERS = 4
TURNS = 2


async def test_disk_reads_of_all_connections_take_turns(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams, "DISK_TURNS", TURNS)
    in_flight = 0
    most = 0
    read_disk = VbLog.read_disk

    async def counted(self: VbLog, *args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            # As a read from the disk would: the other streams run meanwhile.
            await trio.lowlevel.checkpoint()
            return await read_disk(self, *args, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(VbLog, "read_disk", counted)
    store = filled_store(1500)
    # A tail of one byte: every read from the start goes to the disk.
    rig = await upr_front_over_node(nursery, tmp_path, store, tail_bytes=1)
    await rig.catch_up(30)
    highs = [rig.front.logs.logs[vb].high_seqno for vb in range(VBUCKETS)]
    got: dict[tuple[int, int], object] = {}

    async def consume(n: int) -> None:
        client = await rig.consumer(b"reader%d" % n)
        for vb in range(VBUCKETS):
            await client.stream_request(vb, 0, highs[vb], opaque=vb + 1)
        for vb in range(VBUCKETS):
            got[n, vb] = final_state(await client.read_stream(vb + 1))
        await client.aclose()

    with trio.fail_after(60):
        async with trio.open_nursery() as readers:
            for n in range(CONSUMERS):
                readers.start_soon(consume, n)
    assert 1 <= most <= TURNS
    for n in range(CONSUMERS):
        for vb in range(VBUCKETS):
            assert got[n, vb] == store_state(store, vb), (n, vb)
