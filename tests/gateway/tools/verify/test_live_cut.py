"""Side by side on a live bucket: the gateway's TAP and UPR views captured at one cut while
the node keeps writing, verified equal; injected defects found with their key and vbucket,
never taken for changes in flight."""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

# The pipeline extra (pip install -e '.[pipeline]'): without it these tests skip.
pytest.importorskip("pyarrow", reason="needs the pipeline extra")
pytest.importorskip("pyspark", reason="needs the pipeline extra")

from adapters.mcbp.vbucket import vbucket_of
from gateway.cli.serve import ServeOptions, run_serve
from gateway.node.store import Store, StoreError
from gateway.tools.capture import read_capture
from gateway.tools.capture.cut import capture_both
from gateway.tools.capture.records import CaptureRecord, Kind
from gateway.tools.capture.session import CaptureOptions
from gateway.tools.verify.job import VerifyConfig, run_verify
from gateway.tools.verify.synthetic import write_capture
from tests.support.tap_client import start_node

VBUCKETS = 8
ANY_PORT = ("127.0.0.1", 0)
MUT, DEL, EXP, TAP_DELETE = (
    int(k) for k in (Kind.MUTATION, Kind.DELETION, Kind.EXPIRATION, Kind.DELETE)
)


async def _write_live(store: Store, stop: trio.Event) -> None:
    """New keys, rewrites of recent keys and deletes of older ones, until ``stop``.

    The deletes are of plain sets (no expiration), so they must come as deletions."""
    i = 0
    while not stop.is_set():
        i += 1
        for key, value in ((b"live::%06d" % i, b"v%d" % i), (b"live::%06d" % (i - 40), b"r%d" % i)):
            vb = vbucket_of(key, VBUCKETS)
            if i % 2 or key.endswith(b"%06d" % i):
                with contextlib.suppress(StoreError):  # a rewrite of a key deleted since
                    store.set(vb, key, value, now=time.time())
        if i > 200 and i % 3 == 0:
            old = b"live::%06d" % (i - 200)
            with contextlib.suppress(StoreError):  # already gone
                store.delete(vbucket_of(old, VBUCKETS), old, now=time.time())
        await trio.sleep(0.002)  # pacing of the writer (about 500 changes/s), not a wait


def _total(store: Store) -> int:
    return sum(store.high_seqno(vb) for vb in range(VBUCKETS))


def _records(directory: Path) -> list[CaptureRecord]:
    return [CaptureRecord(*r) for _, segment in read_capture(directory) for r in segment.records]


def _cuts(records: list[CaptureRecord]) -> dict[int, int]:
    return {r.vbucket: r.cas for r in records if r.kind == int(Kind.CUT)}


async def test_views_of_a_live_bucket_agree_at_the_cut_and_defects_are_found(
    nursery: trio.Nursery, tmp_path: Path, spark: Any
) -> None:
    store = Store(VBUCKETS, checkpoint_items=50)
    store.populate_sample(400, now=time.time())
    _, node_port = await start_node(nursery, store, vbuckets=VBUCKETS)
    options = ServeOptions(
        tap_listen=ANY_PORT,
        upr_listen=ANY_PORT,
        upr_upstream=("127.0.0.1", node_port),
        tap_upstream=("127.0.0.1", node_port),
        metrics_listen=None,
        state_dir=tmp_path / "state",
    )
    running = await nursery.start(run_serve, options)
    stop_writes = trio.Event()
    nursery.start_soon(_write_live, store, stop_writes)
    with trio.fail_after(120):
        while store.high_seqno(0) < 150:  # the writer has been at it for a while
            await trio.sleep(0.05)
        tap = CaptureOptions("127.0.0.1", running.tap_port, tmp_path / "cap" / "tap")
        upr = CaptureOptions("127.0.0.1", running.upr_port, tmp_path / "cap" / "upr")
        stop = trio.Event()
        async with trio.open_nursery() as capturing:
            result = await capturing.start(
                partial(capture_both, tap, upr, until_caught_up=False, stop=stop)
            )
            # Live changes go on while both record: deletes and rewrites of keys each
            # side saw before, then the cut is taken as a Ctrl-C would take it.
            start = _total(store)
            while _total(store) < start + 1500:
                await trio.sleep(0.05)
            stop.set()
    stop_writes.set()
    assert result.complete, result.summary()

    left, right = _records(tmp_path / "cap" / "tap"), _records(tmp_path / "cap" / "upr")
    cut = _cuts(left)
    assert cut == _cuts(right) == result.cut and len(cut) == VBUCKETS

    config = VerifyConfig(
        str(tmp_path / "cap" / "tap"),
        str(tmp_path / "cap" / "upr"),
        partitions=4,
        progress=False,
        samples=1000,
    )
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert report["agree"], report["mismatches"]["samples"][:5]
    assert report["mismatches"]["total"] == 0

    # Defects on the UPR side, each in its own vbucket, each on a key whose record is its
    # last on that side and inside the cut (what a lost or damaged change looks like).
    last: dict[bytes, int] = {}
    for i, r in enumerate(right):
        if r.kind < 10:
            last[r.key] = i
    left_by_key: dict[bytes, list[CaptureRecord]] = {}
    for r in left:
        if r.kind < 10:
            left_by_key.setdefault(r.key, []).append(r)
    used: set[int] = set()

    def pick(kinds: set[int], also: Any = None) -> int:
        for i, r in enumerate(right):
            if (
                r.kind in kinds
                and r.vbucket not in used
                and last.get(r.key) == i
                and r.cas < cut[r.vbucket]
                and r.key.startswith(b"live::")
                and (also is None or also(r))
            ):
                used.add(r.vbucket)
                return i
        dels = [r for r in right if r.kind in kinds][:3]
        raise AssertionError(
            f"no record of kinds {kinds} to damage: {dels} {[left_by_key.get(r.key) for r in dels]}"
        )

    def deleted_after_plain_set(r: CaptureRecord) -> bool:
        seen = left_by_key.get(r.key, [])
        return (
            len(seen) >= 2
            and seen[-1].kind == TAP_DELETE
            and seen[-2].kind == MUT
            and seen[-2].rev_seqno == r.rev_seqno - 1
            and seen[-2].expiration == 0
        )

    dropped = pick({MUT})
    wrong = pick({MUT})
    missed = pick({DEL})
    as_expiry = pick({DEL}, deleted_after_plain_set)
    swap = next(
        i
        for i in range(1, len(right) - 1)
        if right[i].vbucket not in used
        and right[i].kind < 10
        and right[i + 1].kind < 10
        and right[i].vbucket == right[i + 1].vbucket
        and right[i].key != right[i + 1].key
        and right[i + 1].cas < cut[right[i].vbucket]
    )
    damaged = list(right)
    damaged[wrong] = damaged[wrong]._replace(digest=b"\0" * 16)
    damaged[as_expiry] = damaged[as_expiry]._replace(kind=EXP)
    damaged[swap], damaged[swap + 1] = damaged[swap + 1], damaged[swap]
    for i in sorted((dropped, missed), reverse=True):
        del damaged[i]
    write_capture(tmp_path / "damaged", damaged, side="upr", connection="damaged")

    config.right = str(tmp_path / "damaged")
    report = (await trio.to_thread.run_sync(run_verify, config, spark)).report
    assert not report["agree"]
    found = {(s["check"], s["vbucket"], s["key"].encode()) for s in report["mismatches"]["samples"]}
    in_flight = {(s["vbucket"], s["key"].encode()) for s in report["in_flight"]["samples"]}

    def expect(checks: set[str], r: CaptureRecord) -> None:
        assert any((c, r.vbucket, r.key) in found for c in checks), (checks, r, found)
        assert (r.vbucket, r.key) not in in_flight

    expect({"missing", "value", "metadata"}, right[dropped])
    expect({"value"}, right[wrong])
    expect({"deleted_vs_live"}, right[missed])
    expect({"delete_kind"}, right[as_expiry])
    # The record that now arrives late is the one whose by_seqno goes back.
    expect({"seqno_order"}, right[swap])
