"""Disk reads of published records that the disk no longer gives back whole.

With fsync batch a record is published before its fsync, and a failed
writeback may leave the disk (and so a later read, once the page is
evicted) with other bytes than the ones served; bit rot does the same to
synced records. A stream reading such a record must not skip it as if the
seqnos were gaps: the consumer would hold a history with holes, and no
rollback would ever tell it. ep-engine 3.0 ends the stream instead
(``src/upr-stream.cc``, ``ActiveStream``: a backfill that cannot read ends
the stream rather than move past what it could not read).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from adapters import upr
from tests.gateway.fronts.upr.support import (
    StreamLog,
    filled_store,
    final_state,
    store_state,
    until,
)
from tests.support.fronts import upr_front_over_node


@pytest.mark.parametrize(("name", "dialect"), [("dcp", upr.DCP), ("upr-draft", upr.UPR_DRAFT)])
async def test_a_damaged_published_record_is_not_served_as_a_gap(
    nursery: trio.Nursery, tmp_path: Path, name: str, dialect: upr.Dialect
) -> None:
    """The fast path (DCP) frames blocks from the disk bytes; the draft reads items."""
    store = filled_store(200)
    # A tail of one byte: every read from the start goes to the disk.
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, tail_bytes=1, dialect=name
    )
    await rig.catch_up(20)
    vblog = rig.front.logs.logs[0]
    with trio.fail_after(20):
        await until(lambda: vblog.syncing == 0 and not vblog.unsynced)
    path = vblog.segments[-1].path
    size = path.stat().st_size
    with open(path, "r+b") as f:  # one byte of a record in the middle goes bad
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    client = await rig.consumer(b"reader", dialect=dialect)
    reply = await client.stream_request(0, 0, vblog.high_seqno, opaque=1)
    assert isinstance(reply, upr.StreamRequestOk), reply
    log = StreamLog()
    with trio.fail_after(20), contextlib.suppress(EOFError, trio.BrokenResourceError):
        await client.read_stream(1, log=log)
    await client.aclose()
    # Never told the stream ended OK (it holds a history with holes otherwise) ...
    assert log.end is None or log.end.reason is not upr.StreamEndReason.OK, (
        f"{len(log.items)} of {len(store_state(store, 0))} keys and STREAM_END OK"
    )
    # ... and what did come is the log's history up to the damage: no seqno skipped
    # (every seqno of this log holds an item: nothing was compacted).
    assert [e.by_seqno for e in log.items] == list(range(1, len(log.items) + 1))
    assert final_state(log) != store_state(store, 0)
    rig.running.cancel()
