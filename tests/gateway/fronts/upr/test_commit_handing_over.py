"""An early commit (fsync batch) publishes a log being handed over only once it is synced.

With fsync batch the group commit publishes before the fsync, as ep-engine 3.0
streams from its checkpoints before the flusher persists (src/upr-stream.cc,
``ActiveStream::inMemoryPhase``). A vbucket being handed over
(``VbLog.handing_over``) must serve nothing unsynced until the consumer
replied to SET_VBUCKET_STATE(active): whatever the logs of a commit, the ones
handed over are published only after their fsync, their lock held until
then, while the others are published at once and their locks released before
the fsync; a failed fsync takes back what was not published, without waiting
on a lock the commit holds itself.
"""

from __future__ import annotations

import errno
import tempfile
import threading
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.tap import TapMutation
from gateway.fronts.upr.commit import commit
from gateway.fronts.upr.vblog import LogWriteError, VbLog

NOW = 1_700_000_000.0


class Gate:
    """``VbLog.sync`` waits for ``open`` (in its worker thread); the ``failing``
    vbuckets' fsyncs fail once through it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, failing: set[int]) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self.failing = set(failing)
        real = VbLog.sync

        def sync(vblog: VbLog) -> None:
            self.entered.set()
            self.open.wait()
            if vblog.vbucket in self.failing:
                self.failing.discard(vblog.vbucket)
                raise OSError(errno.EIO, "Input/output error (injected)")
            real(vblog)

        monkeypatch.setattr(VbLog, "sync", sync)


async def _check(root: Path, vbuckets: set[int], handing: set[int], failing: set[int]) -> None:
    logs = {vb: VbLog(root, vb) for vb in sorted(vbuckets)}
    with pytest.MonkeyPatch.context() as monkeypatch:
        gate = Gate(monkeypatch, failing)
        for vb, vblog in logs.items():
            vblog.open()
            vblog.ingest(TapMutation(b"key", b"value", vbucket=vb, cas=1, rev_seqno=1), NOW)
            vblog.handing_over = vb in handing
        failed: list[LogWriteError] = []

        async def run() -> None:
            try:
                await commit(logs, sync=True, early=True)
            except LogWriteError as exc:
                failed.append(exc)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                try:
                    await trio.to_thread.run_sync(gate.entered.wait)
                    # The fsyncs are under way: the others are served, the handed over not.
                    for vb, vblog in logs.items():
                        assert vblog.high_seqno == (0 if vb in handing else 1), vb
                        assert vblog.lock.locked() == (vb in handing), vb
                finally:
                    gate.open.set()  # the worker threads cannot be cancelled
            assert bool(failed) == bool(failing)
            for vb, vblog in logs.items():
                assert not vblog.lock.locked(), vb
                # A failed fsync takes back only what was not served.
                assert vblog.high_seqno == (0 if vb in handing and vb in failing else 1), vb
            await commit(logs, sync=True, early=True)  # the failed ones written again
        for vblog in logs.values():
            assert vblog.high_seqno == 1
            assert not vblog.unsynced and not vblog.sync_in_doubt
            vblog.close()


@settings(max_examples=20)
@given(st.data())
def test_an_early_commit_serves_a_log_handed_over_only_once_synced(data: st.DataObject) -> None:
    vbuckets = data.draw(st.sets(st.integers(0, 3), min_size=1), label="vbuckets")
    within = st.sets(st.sampled_from(sorted(vbuckets)))
    handing = data.draw(within, label="handing over")
    failing = data.draw(within, label="failing fsync")
    with tempfile.TemporaryDirectory() as root:
        trio.run(_check, Path(root), vbuckets, handing, failing)
