"""The UPR front's pipelined group commit: what is acked, when, and in what order.

For any interleaving of the ingest's submissions (logs touched, acks owed)
with commits finishing, ``GroupCommit`` must: start a commit on everything
submitted before it started (the logs of exactly those submissions), send
an ack only after the commit covering its submission returned, send every
ack once, in submission order, and send none of a commit that failed. The
order matters: a TAP producer takes an ack as acknowledging every message
up to its sequence number (ep-engine 2.x src/tapconnection.cc,
``TapProducer::processAck``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import upr
from gateway.fronts.upr.commit import (
    BUSY_BYTES,
    BUSY_SPACING_PER_FILE,
    COMMIT_SPACING_PER_FILE,
    EARLY_COMMIT_INTERVAL,
    MAX_PENDING_BYTES,
    QUIET_BYTES,
    SPACED_BYTES,
    GroupCommit,
)
from gateway.fronts.upr.ingest import RECEIVE_SIZE
from gateway.fronts.upr.vblog import VbLog
from tests.gateway.fronts.upr.support import (
    VBUCKETS,
    caught_up,
    filled_store,
    until,
)
from tests.support.fronts import upr_front_over_node

Step = tuple[str, frozenset[int], int]
"""("submit", vbuckets touched, acks owed) or ("finish", _, _): the commit in progress returns."""

_acks = st.integers(0, 2)
_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"), st.frozensets(st.integers(0, 5), max_size=3), st.integers(0, 2)
        ),
        st.tuples(st.just("finish"), st.just(frozenset()), st.just(0)),
    ),
    max_size=30,
)


class Harness:
    def __init__(self) -> None:
        self.submitted: list[tuple[frozenset[int], list[bytes]]] = []
        self.commits: list[tuple[int, set[int]]] = []
        """(submissions covered, logs committed) of each commit started."""
        self.finished = 0
        """Commits returned."""
        self.sent: list[bytes] = []
        self.release = trio.Event()
        self.fail_next = False
        self.group = GroupCommit(self.commit_logs, self.send)

    async def commit_logs(self, touched: dict[int, Any]) -> None:
        self.commits.append((len(self.submitted), set(touched)))
        await self.release.wait()
        self.release = trio.Event()
        if self.fail_next:
            raise OSError("disk full")
        self.finished += 1

    async def send(self, data: bytes) -> None:
        self.sent += [data[i : i + 4] for i in range(0, len(data), 4)]
        owed = [ack for _, acks in self.submitted for ack in acks]
        assert self.sent == owed[: len(self.sent)]  # in order, each once
        # The submissions acked so far, and every one before them that logged
        # records, were covered by a commit that returned.
        durable = self.commits[self.finished - 1][0] if self.finished else 0
        acked = 0
        while sum(len(acks) for _, acks in self.submitted[:acked]) < len(self.sent):
            acked += 1
        assert all(not vbs for vbs, _ in self.submitted[durable:acked])

    def check_started(self) -> None:
        """Each commit took the logs of exactly the submissions made since the last one."""
        previous = 0
        for covered, logs in self.commits:
            wanted = set().union(*(vbs for vbs, _ in self.submitted[previous:covered]))
            assert logs == wanted and logs
            previous = covered


async def run_steps(steps: list[Step]) -> Harness:
    h = Harness()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.group.run)
        for kind, vbs, acks in steps:
            if kind == "submit":
                owed = [b"%04d" % (len(h.submitted) * 10 + n) for n in range(acks)]
                h.submitted.append((vbs, owed))
                h.group.submit({vb: object() for vb in vbs}, owed)
            else:
                h.release.set()
            await trio.testing.wait_all_tasks_blocked()
            h.check_started()
        # Everything submitted is acked once the commits return.
        flushed = trio.Event()

        async def flush() -> None:
            await h.group.flush()
            flushed.set()

        nursery.start_soon(flush)
        while not flushed.is_set():
            h.release.set()
            await trio.testing.wait_all_tasks_blocked()
        assert h.sent == [ack for _, acks in h.submitted for ack in acks]
        h.check_started()
        nursery.cancel_scope.cancel()
    return h


@settings(max_examples=200, deadline=None)
@given(_steps)
def test_acks_leave_in_order_after_the_commit_that_covers_them(steps: list[Step]) -> None:
    trio.run(run_steps, steps)


async def test_a_failed_commit_sends_none_of_its_acks() -> None:
    h = Harness()
    failed = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.group.run)
            h.submitted.append((frozenset({1}), [b"0001"]))
            h.group.submit({1: object()}, [b"0001"])
            await trio.testing.wait_all_tasks_blocked()
            h.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert h.sent == [b"0001"]
            h.submitted.append((frozenset({2}), [b"0002"]))
            h.group.submit({2: object()}, [b"0002"])
            await trio.testing.wait_all_tasks_blocked()
            h.fail_next = True
            h.release.set()
            await trio.testing.wait_all_tasks_blocked()
    except* OSError:
        failed = True
    assert failed and h.sent == [b"0001"]


async def test_the_reader_waits_when_too_far_ahead_of_the_commits() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.group.run)
        h.submitted.append((frozenset({1}), []))
        h.group.submit({1: object()}, [])
        await trio.testing.wait_all_tasks_blocked()  # its commit is in progress
        h.submitted.append((frozenset({2}), []))
        h.group.submit({2: object()}, [])
        h.group.pending_bytes = 17 * 1024 * 1024  # read since that commit began
        waited = trio.Event()

        async def reader() -> None:
            await h.group.room()
            waited.set()

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not waited.is_set()  # a commit is in progress: the reader waits for it
        h.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert waited.is_set()
        nursery.cancel_scope.cancel()


async def test_consumers_get_items_while_their_fsync_is_held_and_none_is_acked_before_it(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end with a reference node, fsync batch: while fsyncs are held back, the
    ingest keeps logging what the node sends and publishes it at once, as ep-engine 3.0
    streams items from its checkpoints before the flusher persists them
    (src/upr-stream.cc, ``ActiveStream::inMemoryPhase``): a consumer receives them. None
    of it is acked to the node until the fsyncs return (nothing acked is ever lost)."""
    store = filled_store(10)
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, fsync="batch"
    )

    def acked() -> dict[int, int]:
        registration = rig.node.tap.registration("upr-front")
        assert registration is not None
        return {vb: p.seqno for vb, p in registration.positions.items()}

    def all_acked() -> bool:
        registration = rig.node.tap.registration("upr-front")
        return registration is not None and all(
            vb in registration.positions
            and registration.positions[vb].seqno >= store.high_seqno(vb)
            for vb in range(VBUCKETS)
        )

    with trio.fail_after(20):
        await until(lambda: caught_up(rig.front, store) and all_acked())
    release, waiting = threading.Event(), threading.Event()
    real_sync = VbLog.sync

    def held_sync(vblog: VbLog) -> None:  # in a worker thread
        waiting.set()
        assert release.wait(20)
        real_sync(vblog)

    monkeypatch.setattr(VbLog, "sync", held_sync)
    before = acked()
    store.set(0, b"first", b"v", now=time.time())
    try:
        with trio.fail_after(20):  # a commit waits for its fsync
            await trio.to_thread.run_sync(waiting.wait, abandon_on_cancel=True)
        keys = [(n % VBUCKETS, b"more-%d" % n) for n in range(20)]
        for vb, key in keys:
            store.set(vb, key, b"v", now=time.time())
        with trio.fail_after(20):  # logged and published while the commit waits
            await until(lambda: caught_up(rig.front, store))
        client = await rig.consumer(b"early")
        for vb in range(VBUCKETS):
            high = rig.front.logs.logs[vb].high_seqno
            reply = await client.stream_request(vb, 0, high, opaque=vb + 1)
            assert isinstance(reply, upr.StreamRequestOk), reply
            with trio.fail_after(20):
                got = await client.read_stream(vb + 1)
            wanted = {k for v, k in keys if v == vb} | ({b"first"} if vb == 0 else set())
            assert wanted <= {e.key for e in got.items}, vb
        await client.aclose()
        assert waiting.is_set() and not release.is_set()
        assert acked() == before  # nothing of it acked while its fsync is held
    finally:
        release.set()
    with trio.fail_after(20):
        await until(lambda: caught_up(rig.front, store) and all_acked())


async def test_the_ingest_stops_reading_when_too_far_ahead_of_a_held_commit(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded memory end to end: with an fsync held, the in-place ingest reads at most
    ``MAX_PENDING_BYTES`` (and one socket read) beyond the commit in progress, even when
    each read holds few frames (20 KB values: about a dozen frames a read)."""
    store = filled_store(10)
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, fsync="batch"
    )
    await rig.catch_up(20)
    release, waiting = threading.Event(), threading.Event()
    real_sync = VbLog.sync

    def held_sync(vblog: VbLog) -> None:  # in a worker thread
        waiting.set()
        assert release.wait(30)
        real_sync(vblog)

    monkeypatch.setattr(VbLog, "sync", held_sync)
    try:
        store.set(0, b"first", b"v", now=time.time())
        with trio.fail_after(20):  # a commit waits for its fsync
            await trio.to_thread.run_sync(waiting.wait, abandon_on_cancel=True)
        value = bytes(20 * 1024)
        for n in range(2 * MAX_PENDING_BYTES // len(value)):  # twice what may be read ahead
            store.set(n % VBUCKETS, b"big-%d" % n, value, now=time.time())
        group = rig.front.ingest._group
        assert group is not None
        with trio.fail_after(20):  # the reader got that far ahead
            await until(lambda: group.pending_bytes > MAX_PENDING_BYTES)
        await trio.testing.wait_all_tasks_blocked()  # and read no further
        assert group.pending_bytes <= MAX_PENDING_BYTES + RECEIVE_SIZE
    finally:
        release.set()
    await rig.catch_up(30)


class _EarlyLog:
    """A log ``GroupCommit.submit`` writes early (fsync batch): nothing to write."""

    def write_early(self) -> int:
        return 0


Drive = Callable[[GroupCommit, dict[int, Any]], Awaitable[None]]


def _early_commit_starts(files: int, drive: Drive) -> list[tuple[float, int]]:
    """When each commit of an early (fsync batch) ``GroupCommit`` started and how many
    files it covered, while ``drive`` submits to it; trio's mock clock."""
    starts: list[tuple[float, int]] = []

    async def commit_logs(touched: dict[int, Any]) -> None:
        starts.append((trio.current_time(), len(touched)))

    async def send(data: bytes) -> None:
        pass

    async def main() -> None:
        group = GroupCommit(commit_logs, send, early=True)
        logs: dict[int, Any] = {vb: _EarlyLog() for vb in range(files)}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group.run)
            await drive(group, logs)
            await group.flush()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return starts


@pytest.mark.parametrize("files", [1, 8, 64])
def test_early_commits_start_apart_by_their_files(files: int) -> None:
    """Under fsync batch a commit starts ``EARLY_COMMIT_INTERVAL`` after the last one at
    least, or ``COMMIT_SPACING_PER_FILE`` per file it covers when that is longer (its
    CPU grows with the files it fsyncs), files touched during the wait included;
    trio's mock clock, not the wall clock."""

    async def drive(group: GroupCommit, logs: dict[int, Any]) -> None:
        for _ in range(4):
            for vb in range(files):  # one file at a time: the wait grows as they come
                group.submit({vb: logs[vb]}, [b"ack"])
                # A lively stream: what the reader adds as it reads.
                group.pending_bytes = max(group.pending_bytes, QUIET_BYTES)
                await trio.sleep(0.0001)

    starts = _early_commit_starts(files, drive)
    assert sum(n for _, n in starts) >= files and max(n for _, n in starts) == files
    for (a, _), (b, n) in pairwise(starts):
        assert b - a >= max(EARLY_COMMIT_INTERVAL, n * COMMIT_SPACING_PER_FILE) - 1e-9


@pytest.mark.parametrize("files", [8, 64])
def test_early_commits_of_a_busy_stream_start_further_apart_by_their_files(files: int) -> None:
    """From ``BUSY_BYTES`` read since the last commit began (and below ``SPACED_BYTES``)
    a commit waits ``BUSY_SPACING_PER_FILE`` per file it covers: fewer commits of a
    fast stream, each fsync's return costing the loop the GIL (mock clock)."""

    async def drive(group: GroupCommit, logs: dict[int, Any]) -> None:
        for _ in range(4):
            for vb in range(files):
                group.submit({vb: logs[vb]}, [b"ack"])
                group.pending_bytes = max(group.pending_bytes, BUSY_BYTES)
                await trio.sleep(0.0001)

    starts = _early_commit_starts(files, drive)
    assert max(n for _, n in starts) == files
    for (a, _), (b, n) in pairwise(starts):
        assert b - a >= max(EARLY_COMMIT_INTERVAL, n * BUSY_SPACING_PER_FILE) - 1e-9


def test_early_commits_of_a_fast_stream_wait_only_the_interval() -> None:
    """Once ``SPACED_BYTES`` were read since the last commit began, the next starts
    ``EARLY_COMMIT_INTERVAL`` after it whatever its files: a 2.x producer stops at
    10,000 messages not acked (mock clock)."""

    async def drive(group: GroupCommit, logs: dict[int, Any]) -> None:
        for _ in range(4):
            group.submit(logs, [b"ack"])
            group.pending_bytes += SPACED_BYTES  # what the reader adds as it reads
            await group.flush()

    starts = _early_commit_starts(64, drive)
    assert len(starts) == 4
    for (a, _), (b, _) in pairwise(starts):
        assert EARLY_COMMIT_INTERVAL - 1e-9 <= b - a < 64 * COMMIT_SPACING_PER_FILE


def test_early_commits_of_a_quiet_stream_wait_only_the_interval() -> None:
    """Below ``QUIET_BYTES`` read since the last commit began, the next starts
    ``EARLY_COMMIT_INTERVAL`` after it whatever its files: spacing a slow stream's
    cheap commits by files only bunches its fsyncs into bursts (mock clock)."""

    async def drive(group: GroupCommit, logs: dict[int, Any]) -> None:
        for _ in range(4):
            for vb in range(64):  # a file at a time, a few bytes each
                group.submit({vb: logs[vb]}, [b"ack"])
                group.pending_bytes += 100
                await trio.sleep(0.0002)

    starts = _early_commit_starts(64, drive)
    assert max(n for _, n in starts) < 64  # files were not waited for
    for (a, _), (b, _) in pairwise(starts):
        assert EARLY_COMMIT_INTERVAL - 1e-9 <= b - a < EARLY_COMMIT_INTERVAL + 0.001
