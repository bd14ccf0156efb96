"""Two committers fsyncing one vbucket's file at once, and one of them told EIO.

The ingest's group commit (fsync batch: written and published first, fsynced
with no lock held) and a takeover connection's commit (publishes only what
it synced) may fsync the same segment file at the same time. Linux reports a
failed writeback once per open file (``errseq``, since 4.13; both fsync the
same descriptor): the fsync that looks first gets EIO, the other returns 0,
and the pages are no longer dirty, so that 0 proves nothing about them. The
committer told 0 must not settle those bytes and must not let its acks go:
nothing acknowledged may rest on a writeback that failed. Here the file cut
back to what was synced before stands for the dropped pages; the commit after
the failure writes everything not proven again, so what was served (seqnos
included) is what becomes durable.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from adapters.tap import TapMutation
from gateway.fronts.upr.commit import commit
from gateway.fronts.upr.vblog import LogWriteError, VbLog

NOW = 1_700_000_000.0
MAX = 10**9


def feed(vblog: VbLog, prefix: bytes, n: int, cas: int) -> None:
    for i in range(n):
        vblog.ingest(TapMutation(b"%s-%d" % (prefix, i), b"v", cas=cas + i, rev_seqno=1), NOW)


@pytest.mark.parametrize("told", ["group", "takeover"])
async def test_an_fsync_overlapping_a_failed_one_of_the_same_file_acks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, told: str
) -> None:
    """``told``: which committer's fsync gets the EIO (the other gets 0)."""
    vblog = VbLog(tmp_path, 0)
    vblog.open()
    feed(vblog, b"synced", 5, 1)
    await commit({0: vblog}, sync=True, early=True)
    synced = vblog.segments[-1].size
    real_sync = VbLog.sync
    in_flight = [threading.Event(), threading.Event()]
    raised = threading.Event()
    failing = 0 if told == "group" else 1
    calls: list[int] = []
    lock = threading.Lock()

    def errseq_sync(log: VbLog) -> None:  # in worker threads, both at once
        with lock:
            n = len(calls)
            calls.append(n)
        in_flight[n].set()
        assert in_flight[1 - n].wait(10)
        if n == failing:
            raised.set()
            raise OSError(5, "Input/output error")
        assert raised.wait(10)  # looked second: the error was reported already

    monkeypatch.setattr(VbLog, "sync", errseq_sync)
    outcome: dict[str, BaseException | None] = {}

    async def run(name: str, early: bool) -> None:
        try:
            await commit({0: vblog}, sync=True, early=early)
            outcome[name] = None  # the caller would send its acks now
        except LogWriteError as exc:
            outcome[name] = exc

    async with trio.open_nursery() as nursery:
        feed(vblog, b"group", 5, 100)
        nursery.start_soon(run, "group", True)  # written and published, then fsynced
        with trio.fail_after(10):
            await trio.to_thread.run_sync(in_flight[0].wait)
        feed(vblog, b"takeover", 5, 200)
        nursery.start_soon(run, "takeover", False)  # under the lock to its publish
    served = vblog.read(0, MAX, MAX)
    assert {b"group-%d" % i for i in range(5)} <= {i.key for i in served}  # before its fsync
    assert sorted(outcome) == ["group", "takeover"]
    assert all(error is not None for error in outcome.values()), outcome
    # The dropped pages are gone; the next commit writes what was not proven again.
    with open(vblog.segments[-1].path, "r+b") as f:
        f.truncate(synced)
    monkeypatch.setattr(VbLog, "sync", real_sync)
    feed(vblog, b"later", 1, 300)
    await commit({0: vblog}, sync=True, early=True)
    vblog.close()
    again = VbLog(tmp_path, 0)
    again.open()
    keys = {i.key for i in again.read(0, MAX, MAX)}
    assert {i.key for i in served} <= keys
    assert again.continued
    again.close()


async def test_a_commit_cancelled_before_taking_its_failed_fsync_back_leaves_no_doubt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group commit's fsync fails while a takeover committer holds the log's lock,
    and a stop cancels the group commit before it can take the failure back
    (``fsync_epoch``: orphaned). The next commit writes everything not settled
    again, its fsync proves the file, and it acks: no later fsync stays in doubt."""
    vblog = VbLog(tmp_path, 0)
    vblog.open()
    feed(vblog, b"synced", 5, 1)
    await commit({0: vblog}, sync=True, early=True)
    synced = vblog.segments[-1].size
    real_sync = VbLog.sync
    in_fsync, locked = threading.Event(), threading.Event()

    def failing_sync(log: VbLog) -> None:  # in the worker thread
        in_fsync.set()
        assert locked.wait(10)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(VbLog, "sync", failing_sync)
    feed(vblog, b"group", 5, 100)
    with trio.CancelScope() as stop:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(commit, {0: vblog}, sync=True, early=True))
            with trio.fail_after(10):
                await trio.to_thread.run_sync(in_fsync.wait)
            await vblog.lock.acquire()  # a takeover committer, between write and publish
            locked.set()
            with trio.fail_after(10):
                while not vblog.fsyncs.failures or vblog.syncing:
                    await vblog.sync_returned.wait()
            await trio.testing.wait_all_tasks_blocked()  # the commit waits for the lock
            stop.cancel()
    vblog.lock.release()
    assert vblog.fsyncs.orphaned and vblog.sync_in_doubt
    served = vblog.read(0, MAX, MAX)
    assert {b"group-%d" % i for i in range(5)} <= {i.key for i in served}
    with open(vblog.segments[-1].path, "r+b") as f:  # the pages the failure dropped
        f.truncate(synced)
    monkeypatch.setattr(VbLog, "sync", real_sync)
    feed(vblog, b"later", 1, 300)
    await commit({0: vblog}, sync=True, early=True)  # acks: raises nothing
    assert not vblog.sync_in_doubt and not vblog.unsynced
    feed(vblog, b"after", 1, 400)
    await commit({0: vblog}, sync=True, early=False)
    vblog.close()
    again = VbLog(tmp_path, 0)
    again.open()
    keys = {i.key for i in again.read(0, MAX, MAX)}
    assert {i.key for i in served} | {b"later-0", b"after-0"} <= keys
    assert again.continued
    again.close()
