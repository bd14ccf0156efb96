"""Direct captures of the reference node over TAP and UPR."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest
import trio

from gateway.node.store import Store
from gateway.tools.capture import CaptureRecord, Kind, digest, read_capture
from gateway.tools.capture.session import CaptureFailed, CaptureOptions
from gateway.tools.capture.tap_capture import capture_tap
from gateway.tools.capture.upr_capture import capture_upr
from tests.support import tap_client
from tests.support.upr_client import start_node

VBUCKETS = 4


def filled_store(now: float) -> Store:
    store = Store(VBUCKETS, checkpoint_items=5)
    store.populate_sample(60, value_size=20, now=now)
    for n in range(0, 60, 7):  # deletions
        key = b"sample::%06d" % n
        vb = next(v for v in range(VBUCKETS) if store.lookup(v, key) is not None)
        store.delete(vb, key, now=now)
    store.set(1, b"short-lived", b"x", expiration=int(now) + 1, now=now)
    store.expire(now + 5)  # an expiration tombstone
    store.set(2, b"sample::000001", b"rewritten", flags=0x01020304, now=now)
    return store


def captured(directory: Path) -> list[CaptureRecord]:
    out: list[CaptureRecord] = []
    for _, segment in read_capture(directory):
        assert segment.torn is None
        out.extend(segment.typed())
    return out


def final_items(records: list[CaptureRecord]) -> dict[tuple[int, bytes], CaptureRecord]:
    final: dict[tuple[int, bytes], CaptureRecord] = {}
    for r in records:
        if Kind(r.kind).is_item:
            final[(r.vbucket, r.key)] = r
    return final


def store_state(store: Store) -> dict[tuple[int, bytes], tuple]:
    state = {}
    for vb in range(VBUCKETS):
        for item in store.items_since(vb, 0):
            state[(vb, item.key)] = item
    return state


async def test_upr_capture_until_caught_up_records_every_item(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    now = time.time()
    store = filled_store(now)
    _, port = await start_node(nursery, store)
    result = await capture_upr(CaptureOptions("127.0.0.1", port, tmp_path, until_caught_up=True))
    assert result.stopped == "caught-up"
    assert result.caught_up == set(range(VBUCKETS)) and result.dropped == 0
    records = captured(tmp_path)
    expected = store_state(store)
    got = final_items(records)
    assert set(got) == set(expected)
    for where, item in expected.items():
        record = got[where]
        assert (record.by_seqno, record.rev_seqno, record.cas) == (
            item.by_seqno,
            item.rev_seqno,
            item.cas,
        )
        if item.deleted:
            want = Kind.EXPIRATION if item.kind.name == "EXPIRATION" else Kind.DELETION
            assert record.kind == want and record.digest is None
        else:
            assert record.kind == Kind.MUTATION
            assert record.digest == digest(item.value) and record.flags == item.flags
        assert record.snap_start is not None and record.snap_start <= record.by_seqno
        assert record.by_seqno <= record.snap_end
    assert any(r.kind == Kind.EXPIRATION for r in records)
    per_vb = defaultdict(list)
    for r in records:
        per_vb[r.vbucket].append(r)
    for vb, rs in per_vb.items():
        assert rs[0].kind == Kind.SNAPSHOT and rs[-1].kind == Kind.STREAM_END, vb
        seqnos = [r.by_seqno for r in rs if r.by_seqno is not None]
        assert seqnos == sorted(seqnos) and seqnos[-1] == store.high_seqno(vb)


async def test_tap_capture_until_caught_up_records_every_item(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    now = time.time()
    store = filled_store(now)
    _, port = await start_node(nursery, store, tap_noop_interval=0.5)
    result = await capture_tap(CaptureOptions("127.0.0.1", port, tmp_path, until_caught_up=True))
    assert result.stopped == "caught-up" and result.caught_up == set(range(VBUCKETS))
    records = captured(tmp_path)
    got = final_items(records)
    expected = store_state(store)
    assert set(got) == set(expected)
    for where, item in expected.items():
        record = got[where]
        assert record.by_seqno is None
        assert (record.rev_seqno, record.cas) == (item.rev_seqno, item.cas)
        if item.deleted:
            assert record.kind == Kind.DELETE
        else:
            # Flags come back in network order whatever order TAP carried them in.
            assert record.flags == item.flags and record.digest == digest(item.value)
    kinds = [Kind(r.kind) for r in records]
    assert kinds.count(Kind.BACKFILL_END) == VBUCKETS


async def test_live_capture_sees_later_writes_and_closes_cleanly_when_cancelled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(VBUCKETS)
    _, port = await tap_client.start_node(nursery, store)  # wakes streams on store changes
    for runner, out in ((capture_upr, tmp_path / "upr"), (capture_tap, tmp_path / "tap")):
        with trio.CancelScope() as scope:
            options = CaptureOptions("127.0.0.1", port, out)
            result = await nursery.start(runner, options)
            for n in range(20):
                store.set(n % VBUCKETS, b"live%d" % n, b"v", now=time.time())
            with trio.fail_after(10):
                while sum(result.kinds.values()) < 20 or len(final_items(captured(out))) < 20:
                    await trio.sleep(0.05)
            scope.cancel()
        assert {k for _, k in final_items(captured(out))} >= {b"live%d" % n for n in range(20)}


async def test_live_capture_stops_when_cancelled(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, port = await start_node(nursery, Store(VBUCKETS))
    done = trio.Event()

    async def run() -> None:
        with trio.move_on_after(0.3):
            await capture_upr(CaptureOptions("127.0.0.1", port, tmp_path))
        done.set()

    nursery.start_soon(run)
    with trio.fail_after(10):
        await done.wait()
    assert captured(tmp_path) == []  # an empty, cleanly closed segment


async def test_sasl_and_refusals(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = Store(VBUCKETS)
    store.populate_sample(10, now=time.time())
    _, port = await start_node(nursery, store, users={"admin": "secret"})
    good = CaptureOptions(
        "127.0.0.1", port, tmp_path / "ok", until_caught_up=True, user="admin", password="secret"
    )
    assert (await capture_upr(good)).stopped == "caught-up"
    assert len(final_items(captured(tmp_path / "ok"))) == 10
    bad = CaptureOptions("127.0.0.1", port, tmp_path / "bad", user="admin", password="wrong")
    with pytest.raises(CaptureFailed, match="authentication as 'admin' refused"):
        await capture_tap(bad)
    anonymous = CaptureOptions("127.0.0.1", port, tmp_path / "anon")
    with pytest.raises(CaptureFailed, match="STAT vbucket-seqno refused"):
        await capture_upr(anonymous)
    missing = CaptureOptions(
        "127.0.0.1", port, tmp_path / "m", user="admin", password="secret", vbuckets=(1, 99)
    )
    with pytest.raises(CaptureFailed, match=r"vbuckets \[99\] are not active"):
        await capture_upr(missing)


async def test_draft_dialect_capture(nursery: trio.Nursery, tmp_path: Path) -> None:
    store = Store(VBUCKETS)
    store.populate_sample(30, now=time.time())
    _, port = await start_node(nursery, store, dialect="upr-draft")
    options = CaptureOptions("127.0.0.1", port, tmp_path, until_caught_up=True, dialect="upr-draft")
    result = await capture_upr(options)
    assert result.stopped == "caught-up"
    records = captured(tmp_path)
    assert len(final_items(records)) == 30
    kinds = {Kind(r.kind) for r in records}
    assert {Kind.SNAPSHOT_START, Kind.SNAPSHOT_END, Kind.STREAM_END} <= kinds
