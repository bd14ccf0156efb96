"""The two-sided capture: its per-side watch, and the command stopping both sides at one cut."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hypothesis.strategies as st
import trio
from hypothesis import given

from gateway.node.store import Store
from gateway.tools.capture import read_capture
from gateway.tools.capture.cut import SideWatch
from gateway.tools.capture.records import CaptureRecord, Kind, item_record, marker_record
from tests.support.tap_client import start_node

ROOT = Path(__file__).resolve().parents[4]

_events = st.one_of(
    st.tuples(st.just("item"), st.integers(0, 3), st.integers(1, 1000)),
    st.tuples(st.sampled_from(["backfill_start", "backfill_end"]), st.integers(0, 3), st.just(0)),
)


@given(st.lists(_events, max_size=60), st.integers(0, 1000))
def test_a_side_reaches_the_cut_once_past_it_and_out_of_backfill(
    events: list[tuple[str, int, int]], cut: int
) -> None:
    watch = SideWatch("tap")
    for what, vb, cas in events:
        if what == "item":
            watch.seen(
                item_record(vb, b"k", "mutation", by_seqno=None, rev_seqno=1, cas=cas, arrival=0)
            )
        else:
            watch.seen(marker_record(vb, what, arrival=0))
    for vb in range(4):
        top = max((c for w, v, c in events if w == "item" and v == vb), default=0)
        marks = [w for w, v, _ in events if v == vb and w != "item"]
        backfilling = bool(marks) and marks[-1] == "backfill_start"
        assert watch.max_cas.get(vb, 0) == top
        assert watch.reached(vb, cut) == (top >= cut and not backfilling)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.tools.capture", "capture", *args]


def _records(directory: Path) -> list[CaptureRecord]:
    return [CaptureRecord(*r) for _, s in read_capture(directory) for r in s.records]


def _cuts(directory: Path) -> dict[int, int]:
    return {r.vbucket: r.cas for r in _records(directory) if r.kind == int(Kind.CUT)}


async def test_both_sides_of_a_live_node_stop_at_one_cut(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    store = Store(4, checkpoint_items=20)
    store.populate_sample(300, now=time.time())
    _, port = await start_node(nursery, store, vbuckets=4)

    async def write() -> None:
        i = 0
        while True:
            i += 1
            key = b"live::%d" % i
            store.set(i % 4, key, b"v", now=time.time())
            await trio.sleep(0.005)  # pacing of the writer, not a wait

    nursery.start_soon(write)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    here = f"127.0.0.1:{port}"
    done = await trio.run_process(
        _cli("--tap", here, "--upr", here, "--out", str(tmp_path / "once"), "--until-caught-up"),
        capture_stdout=True,
        capture_stderr=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert b"cut over 4 vbuckets: cut reached" in done.stdout
    tap_cut, upr_cut = _cuts(tmp_path / "once" / "tap"), _cuts(tmp_path / "once" / "upr")
    assert tap_cut == upr_cut and set(tap_cut) == {0, 1, 2, 3}
    for side in ("tap", "upr"):  # every change inside the cut is on both sides
        inside = {
            (r.vbucket, r.key, r.cas)
            for r in _records(tmp_path / "once" / side)
            if r.kind < 10 and r.cas <= tap_cut[r.vbucket]
        }
        assert len(inside) >= 300
        if side == "tap":
            tap_inside = inside
    assert inside == tap_inside

    # Without --until-caught-up the first SIGINT takes the cut; exit 0 once both reach it.
    live = tmp_path / "live"
    process = await trio.lowlevel.open_process(
        _cli("--tap", here, "--upr", here, "--out", str(live)), env=env, stdout=subprocess.PIPE
    )
    try:
        with trio.fail_after(30):
            while not (live / "upr").exists() or len(_records(live / "upr")) < 300:
                await trio.sleep(0.1)
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    assert code == 0
    assert _cuts(live / "tap") == _cuts(live / "upr") and len(_cuts(live / "tap")) == 4
