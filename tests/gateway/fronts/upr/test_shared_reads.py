"""Streams at the same place of the same log share one read (disk or tail) and its framing.

A batch framed for one stream and patched with another's opaque is byte for
byte what that stream's own read frames (the opaque is the only field of a
UPR frame header that differs between streams of one vbucket: memcached
3.0 protocol_binary.h ``protocol_binary_request_header``); consumers reading
one vbucket together each get all of it, through fewer reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from adapters.translate.log_records import ItemKind
from adapters.translate.log_to_upr_fast import BatchEncoder
from gateway.fronts.upr.producer import UprConnection
from gateway.fronts.upr.shared_reads import SharedReads, shared_reads
from tests.adapters.translate.test_log_to_upr_fast import U32, build, rows
from tests.gateway.fronts.upr import support

VB = 1
CONSUMERS = 3


class Stand:
    """A stand-in for a log or a segment: only its identity counts."""


@settings(max_examples=200, deadline=None)
@given(
    st.lists(rows, max_size=60),
    st.lists(st.integers(1, 3), min_size=60, max_size=60),
    U32,
    U32,
    st.booleans(),
    st.booleans(),
)
def test_a_batch_patched_with_another_opaque_is_what_that_stream_frames(
    generated: list[Any], gaps: list[int], first: int, second: int, expiry: bool, times: bool
) -> None:
    items = build(generated, gaps)

    def encoder(opaque: int) -> BatchEncoder:
        return BatchEncoder(upr.DCP, opaque, VB, expiry_opcode=expiry, delete_times=times)

    framed = encoder(first).encode(items)
    shared = SharedReads()
    log: Any = Stand()
    segment: Any = Stand()
    key: Any = ("key",)
    shared.put(key, log, segment, framed, first, None, True, 100, 50, wanted=2)
    for opaque in (second, first):
        got = shared.take(key, log, segment, 100, opaque)
        assert got is not None and got.encoded == encoder(opaque).encode(items)
    assert shared.take(key, log, segment, 100, first) is None  # both wanted took it
    assert shared.bytes == 0


def test_a_batch_is_reused_only_where_a_read_would_cut_it_alike() -> None:
    items = build([(ItemKind.MUTATION, b"a", b"v", False, 0, False, (1, 1, 0, 0, 0, 0, 0))], [1])
    framed = BatchEncoder(upr.DCP, 1, VB).encode(items)
    shared = SharedReads()
    log: Any = Stand()
    segment: Any = Stand()
    key: Any = ("key",)
    # Not cut by its room (50 of 100 bytes left): any room over the 50 read cuts it alike.
    shared.put(key, log, segment, framed, 1, None, True, 100, 50, wanted=5)
    assert shared.take(key, log, segment, 50, 1) is None
    assert shared.take(key, log, segment, 51, 1) is not None
    assert shared.take(key, Stand(), segment, 100, 1) is None
    assert shared.take(key, log, Stand(), 100, 1) is None
    # Cut by its room: only that same room.
    shared.put(key, log, segment, framed, 1, None, True, 100, 0, wanted=5)
    assert shared.take(key, log, segment, 200, 1) is None
    assert shared.take(key, log, segment, 100, 1) is not None
    # No stream behind it: not kept; and never more than the limit.
    shared.put(("other",), log, segment, framed, 1, None, True, 100, 50, wanted=0)
    assert shared.take(("other",), log, segment, 100, 1) is None
    small = SharedReads(limit=len(framed.data))
    small.put(("a",), log, segment, framed, 1, None, True, 100, 50, wanted=1)
    small.put(("b",), log, segment, framed, 1, None, True, 100, 50, wanted=1)
    assert small.take(("a",), log, segment, 100, 1) is None
    assert small.take(("b",), log, segment, 100, 1) is not None
    assert small.bytes == 0


@pytest.mark.parametrize("tail_bytes", [1, 1 << 20], ids=["disk", "tail"])
async def test_consumers_reading_a_vbucket_together_share_its_reads(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tail_bytes: int
) -> None:
    """With a tail of one byte every read from the start goes to the disk (the others
    wait for the one reading it); with a large one, to the in-memory tail."""
    store = support.filled_store(3000)
    _, node_port = await support.start_node(nursery, store)
    front, port, _ = await support.start_front(nursery, tmp_path, node_port, tail_bytes=tail_bytes)
    with trio.fail_after(30):
        await support.until(lambda: support.caught_up(front, store))
    vblog = front.logs.logs[VB]
    assert vblog.in_memory(0) is (tail_bytes > 1)
    gate = trio.Event()
    held = 0
    send_budget = UprConnection.send_budget

    async def gated(self: UprConnection, *args: Any, **kwargs: Any) -> int:
        nonlocal held
        held += 1
        await gate.wait()
        return await send_budget(self, *args, **kwargs)

    monkeypatch.setattr(UprConnection, "send_budget", gated)
    clients = [await support.open_producer(port, b"reader%d" % n) for n in range(CONSUMERS)]
    got: dict[int, object] = {}

    async def consume(n: int) -> None:
        got[n] = support.final_state(await clients[n].read_stream(n + 10))

    with trio.fail_after(60):
        for n, client in enumerate(clients):
            await client.stream_request(VB, 0, vblog.high_seqno, opaque=n + 10)
        # Every stream waits at the start, so the first batch is one read for all.
        await support.until(lambda: held == CONSUMERS)
        gate.set()
        async with trio.open_nursery() as readers:
            for n in range(CONSUMERS):
                readers.start_soon(consume, n)
    for client in clients:
        await client.aclose()
    assert all(got[n] == support.store_state(store, VB) for n in range(CONSUMERS))
    assert shared_reads().hits >= CONSUMERS - 1
