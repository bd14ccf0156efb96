"""Damage found while serving: the log is set aside, started over and fetched again.

Start-up sets aside a log it cannot prove (``vblog``); a stream that finds
damage later does the same (``damage``). Its streams end as ep-engine 3.0
ends the streams of a vbucket whose state changes under them
(``src/upr-stream.cc``, ``END_STREAM_STATE``), and a consumer asking again
with its old uuid rolls back to 0, as 3.0 answers an unknown uuid
(``src/failover-table.cc``, ``needsRollback``), then gets the node's data.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from adapters import upr
from tests.gateway.fronts.upr.support import (
    filled_store,
    final_state,
    store_state,
    until,
)
from tests.support.fronts import upr_front_over_node

DAMAGED = 0
OTHER = 1


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


async def test_damage_found_while_serving_sets_the_log_aside_and_fetches_it_again(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = filled_store(200)
    # A tail of one byte: every read from the start goes to the disk.
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, tail_bytes=1
    )
    await rig.catch_up(20)
    vblog = rig.front.logs.logs[DAMAGED]
    with trio.fail_after(20):
        await until(lambda: vblog.syncing == 0 and not vblog.unsynced)
    # A consumer holds the whole history of the vbucket (it asks again with its uuid).
    client = await rig.consumer(b"reader")
    reply = await client.stream_request(DAMAGED, 0, vblog.high_seqno, opaque=1)
    assert isinstance(reply, upr.StreamRequestOk), reply
    with trio.fail_after(20):
        log = await client.read_stream(1)
    assert final_state(log) == store_state(store, DAMAGED)
    seen = log.items[-1].by_seqno
    path = vblog.segments[-1].path
    size = path.stat().st_size
    with open(path, "r+b") as f:  # one byte of a record in the middle goes bad
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged_files = files_of(vblog.dir)
    old_uuid = vblog.failover.entries[0][0]

    # Another connection, live on another vbucket, is left alone.
    other = await rig.consumer(b"other")
    reply = await other.stream_request(OTHER, 0, opaque=7)
    assert isinstance(reply, upr.StreamRequestOk), reply

    caplog.set_level(logging.INFO)
    # Another one, reading from the start, finds the damage.
    reader = await rig.consumer(b"reader-2")
    reply = await reader.stream_request(DAMAGED, 0, vblog.high_seqno, opaque=1)
    assert isinstance(reply, upr.StreamRequestOk), reply
    with trio.fail_after(20):
        log = await reader.read_stream(1)
    assert log.end is not None and log.end.reason is upr.StreamEndReason.STATE_CHANGED

    # Set aside untouched, with why.txt; counted once; one warning, no traceback.
    aside = list((tmp_path / "set-aside").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(f"vb-{DAMAGED:04d}-")
    kept = files_of(aside[0])
    assert kept.pop("why.txt").decode().count(path.name) == 1
    assert kept == damaged_files
    assert rig.front.stats.upr_log.log_damage_total == {DAMAGED: 1}
    assert rig.front.stats.upr_log.logs_set_aside_total == {"segment_damaged": 1}
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert f"vbucket {DAMAGED}:" in line and path.name in line and "offset" in line
    assert "\n" not in line and warnings[0].exc_info is None

    # Asking again with its old uuid: back to 0, then the node's data.
    reply = await client.stream_request(DAMAGED, seen, uuid=old_uuid, snap=(seen, seen), opaque=2)
    assert isinstance(reply, upr.StreamRequestRollback) and reply.rollback_seqno == 0, reply
    await rig.catch_up(20)
    fresh = rig.front.logs.logs[DAMAGED]
    assert fresh is not vblog and not fresh.needs_refetch
    new_uuid = fresh.failover.entries[0][0]
    assert new_uuid != old_uuid
    reply = await client.stream_request(DAMAGED, 0, fresh.high_seqno, uuid=new_uuid, opaque=3)
    assert isinstance(reply, upr.StreamRequestOk), reply
    with trio.fail_after(20):
        log = await client.read_stream(3)
    assert log.end is not None and log.end.reason is upr.StreamEndReason.OK
    assert final_state(log) == store_state(store, DAMAGED)

    others = [c.streams.get(OTHER) for c in rig.front.connections.values()]
    assert [s.live for s in others if s is not None] == [True]
    # The connection that found the damage is still served.
    reply = await reader.stream_request(OTHER, 0, 1, opaque=4)
    assert isinstance(reply, upr.StreamRequestOk), reply
    with trio.fail_after(20):
        log = await reader.read_stream(4)
    assert log.end is not None and log.end.reason is upr.StreamEndReason.OK
    await reader.aclose()
    await client.aclose()
    await other.aclose()
    rig.running.cancel()
