"""Damaged logs of the UPR front, end to end: a reference node upstream, real consumers.

Every case ends with consumers holding exactly the node's data, and no
(vbucket, uuid, seqno) ever names two different versions: a log that
cannot be proven is set aside, gets a new uuid above every seqno handed
out (a consumer resuming in the old history is told to roll back to 0, as
3.0's ``FailoverTable::needsRollback`` does for an unknown uuid), and is
fetched again from the TAP node, which a DEREGISTER_TAP_CLIENT makes
backfill it (ep-engine ``TapProducer::registerCursor`` would otherwise
resume the registered client's cursor).
"""

from __future__ import annotations

import io
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from adapters import upr
from gateway.fronts.upr.checklog import EXIT_NOT_PROVEN, EXIT_PROVEN, check_state_dir
from gateway.fronts.upr.segments import frame
from gateway.metrics.figures import GatewayStats
from tests.gateway.fronts.upr.log_damage import Consumer, catch_up, files_of, settled, start
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    filled_store,
    start_node,
    store_state,
    write_load,
)

DAMAGED = 1
SEGMENT_BYTES = 1024
"""Small segments, so a vbucket has several and one in the middle can go."""

Damage = Callable[[Path], tuple[str, str]]
"""Damages the state directory; returns (problem kind, the file the log line must name)."""


def _vbdir(state: Path) -> Path:
    return state / f"vb-{DAMAGED:04d}"


def _segments(state: Path) -> list[Path]:
    return sorted(_vbdir(state).glob("*.seg"), key=lambda p: int(p.stem))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def delete_a_middle_segment(state: Path) -> tuple[str, str]:
    segments = _segments(state)
    assert len(segments) >= 3, segments
    segments[1].unlink()
    return "segment_missing", segments[1].name


def delete_every_segment(state: Path) -> tuple[str, str]:
    segments = _segments(state)
    for path in segments:
        path.unlink()
    return "segment_missing", segments[0].name


def delete_the_vbucket_directory(state: Path) -> tuple[str, str]:
    shutil.rmtree(_vbdir(state))
    return "directory_missing", _vbdir(state).name + "/"


def flip_a_bit_mid_segment(state: Path) -> tuple[str, str]:
    sealed = _segments(state)[0]
    _flip(sealed, sealed.stat().st_size // 2)
    return "segment_damaged", sealed.name


def flip_a_bit_in_the_meta(state: Path) -> tuple[str, str]:
    meta = _vbdir(state) / "meta.msgpack"
    _flip(meta, meta.stat().st_size // 2)
    return "meta_damaged", "meta.msgpack"


def truncate_the_meta(state: Path) -> tuple[str, str]:
    meta = _vbdir(state) / "meta.msgpack"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    return "meta_damaged", "meta.msgpack"


def delete_the_meta(state: Path) -> tuple[str, str]:
    (_vbdir(state) / "meta.msgpack").unlink()
    return "meta_missing", "meta.msgpack"


DAMAGES = [
    delete_a_middle_segment,
    delete_every_segment,
    delete_the_vbucket_directory,
    flip_a_bit_mid_segment,
    flip_a_bit_in_the_meta,
    truncate_the_meta,
    delete_the_meta,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__ for d in DAMAGES])
async def test_a_log_that_cannot_be_proven_is_set_aside_and_fetched_again(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Damage
) -> None:
    store = filled_store(60)
    _, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    gateway = await start(nursery, tmp_path, node_port, segment_bytes=SEGMENT_BYTES)
    await settled(gateway.front, store)  # streaming live: the load comes in many small batches
    await write_load(store, 300, seed=3)
    await settled(gateway.front, store)
    consumer = Consumer()
    await catch_up(consumer, gateway.front, gateway.port)
    before = gateway.front.logs.logs[DAMAGED]
    old_uuids = {u for u, _ in before.failover.entries}
    old_reserved = before.reserved
    others = {vb: v.failover.uuid for vb, v in gateway.front.logs.logs.items() if vb != DAMAGED}
    await gateway.stop()

    kind, name = damage(tmp_path)
    kept = files_of(_vbdir(tmp_path)) if _vbdir(tmp_path).is_dir() else {}
    report = io.StringIO()
    assert check_state_dir(tmp_path, report) == EXIT_NOT_PROVEN
    line = next(x for x in report.getvalue().splitlines() if x.startswith(f"vb {DAMAGED}:"))
    assert "NOT PROVEN" in line and name in line, line
    await write_load(store, 200, seed=4)  # the node moves on while the gateway is down

    stats = GatewayStats()
    caplog.set_level(logging.WARNING, logger="gateway.fronts.upr")
    caplog.clear()
    gateway = await start(nursery, tmp_path, node_port, stats=stats, segment_bytes=SEGMENT_BYTES)
    await settled(gateway.front, store)
    vblog = gateway.front.logs.logs[DAMAGED]
    assert vblog.problems[0].kind == kind
    assert stats.upr_log.logs_set_aside_total == {kind: 1}
    lines = [r.getMessage() for r in caplog.records if f"vbucket {DAMAGED}:" in r.getMessage()]
    assert len(lines) == 1 and name in lines[0] and "re-fetching" in lines[0], lines
    # Kept aside as they were, never destroyed.
    if kept:
        assert vblog.set_aside is not None
        assert {k: v for k, v in files_of(vblog.set_aside).items() if k != "why.txt"} == kept
    # A new history: a uuid the vbucket never had, above every seqno handed out.
    ((uuid, start_seqno),) = vblog.failover.entries
    assert uuid not in old_uuids and start_seqno >= old_reserved

    answers = await catch_up(consumer, gateway.front, gateway.port)
    assert isinstance(answers[DAMAGED], upr.StreamRequestRollback), answers[DAMAGED]
    for vb in range(VBUCKETS):
        assert consumer.state(vb) == store_state(store, vb), vb
        if vb != DAMAGED:
            assert isinstance(answers[vb], upr.StreamRequestOk)  # no rollback
            assert gateway.front.logs.logs[vb].failover.uuid == others[vb]
    assert not vblog.needs_refetch
    await gateway.stop()
    report = io.StringIO()
    assert check_state_dir(tmp_path, report) == EXIT_PROVEN, report.getvalue()
    if kept:
        assert f"set aside earlier: set-aside/vb-{DAMAGED:04d}-" in report.getvalue()


async def test_a_torn_tail_is_cut_and_consumers_resume_without_rollback(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = filled_store(60)
    _, node_port = await start_node(nursery, store, checkpoint_interval=0.05)
    gateway = await start(
        nursery, tmp_path, node_port, segment_bytes=SEGMENT_BYTES, close_logs=False
    )
    await write_load(store, 300, seed=3)
    await settled(gateway.front, store)
    consumer = Consumer()
    await catch_up(consumer, gateway.front, gateway.port)
    await gateway.stop()  # no clean close: as if killed
    # Half of a record, as an append the crash interrupted leaves it.
    half = frame([0, 10**6, 0, b"key", b"value" * 20, 1, 2, 0, 0, 0, 0, 0, 0, 0.0, 0])
    active = _segments(tmp_path)[-1]
    with open(active, "ab") as f:
        f.write(half[: len(half) // 2])
    report = io.StringIO()
    assert check_state_dir(tmp_path, report) == EXIT_PROVEN
    assert f"torn tail of {len(half) // 2} bytes in vb-0001/{active.name}" in report.getvalue()
    await write_load(store, 200, seed=4)
    stats = GatewayStats()
    gateway = await start(nursery, tmp_path, node_port, stats=stats, segment_bytes=SEGMENT_BYTES)
    await settled(gateway.front, store)
    vblog = gateway.front.logs.logs[DAMAGED]
    assert vblog.problems == [] and vblog.set_aside is None
    assert vblog.torn_bytes == len(half) // 2
    cut = next(s for s in vblog.segments if s.path == active)
    assert active.stat().st_size == cut.size  # cut back to its last whole record
    assert not stats.upr_log.logs_set_aside_total
    answers = await catch_up(consumer, gateway.front, gateway.port)
    for vb in range(VBUCKETS):
        assert isinstance(answers[vb], upr.StreamRequestOk), (vb, answers[vb])
        assert consumer.state(vb) == store_state(store, vb), vb
    await gateway.stop()
