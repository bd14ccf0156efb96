"""The clean-close mark after an fsync that failed while the gateway was stopping.

Linux reports a failed writeback once per open file (``errseq``): the fsync
that sees it gets EIO, and a later fsync of the same file returns 0 although
the pages it did not write are lost (they are no longer dirty). With fsync
batch those pages hold records already served. A stop (the front's scope
cancelled) that lands while such an fsync is in flight leaves the failure
unhandled; the clean close that follows must then write those bytes again
before it marks the log clean, or the mark vouches for records the disk
never got (the next start would continue the history instead of adding a
failover entry at the proven end, as ep-engine 3.0's warmup does after an
unclean shutdown, ``src/warmup.cc``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from gateway.fronts.upr.proof import META_NAME, read_meta
from gateway.fronts.upr.segment_file import SegmentFile
from gateway.fronts.upr.vblog import VbLog
from tests.gateway.fronts.upr.support import (
    filled_store,
    until,
)
from tests.support.fronts import upr_front_over_node


async def test_a_clean_close_after_an_unhandled_failed_fsync_writes_the_served_bytes_again(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = filled_store(10)
    rig = await upr_front_over_node(
        nursery, tmp_path, store, node={"checkpoint_interval": 0.05}, fsync="batch"
    )
    await rig.catch_up(20)
    vblog = rig.front.logs.logs[0]
    with trio.fail_after(20):
        await until(lambda: vblog.syncing == 0 and not vblog.unsynced)
    synced = vblog.segments[-1].size
    release, waiting = threading.Event(), threading.Event()
    lost: list[int] = []  # the file's size when its writeback failed
    rewrites: list[tuple[int, int]] = []  # (offset, bytes) written again after it
    real_sync, real_write_again = VbLog.sync, SegmentFile.write_again

    def sync(log: VbLog) -> None:  # in a worker thread
        if log is vblog and not lost and log.unsynced:
            assert log.file.fd is not None
            waiting.set()
            release.wait(20)
            lost.append(os.fstat(log.file.fd).st_size)
            raise OSError(5, "Input/output error")  # reported once: later fsyncs say 0
        real_sync(log)

    def write_again(file: SegmentFile) -> None:
        if file is vblog.file and lost:
            rewrites.append((file.settled_size, len(file.written)))
        real_write_again(file)

    monkeypatch.setattr(VbLog, "sync", sync)
    monkeypatch.setattr(SegmentFile, "write_again", write_again)
    for n in range(5):
        store.set(0, b"served-%d" % n, b"v", now=time.time())
    with trio.fail_after(20):
        await until(lambda: vblog.high_seqno > 0 and waiting.is_set())
    assert vblog.written_size > synced  # published before the fsync that will fail
    rig.running.cancel()  # a stop while that fsync is in flight: the logs close cleanly
    await trio.testing.wait_all_tasks_blocked()
    release.set()
    with trio.fail_after(20):
        await rig.running.stopped.wait()
    assert lost and lost[0] > synced
    meta, wrong = read_meta(vblog.dir / META_NAME)
    assert wrong is None and meta is not None
    if meta.clean:
        # Marked clean: then every byte the failed writeback dropped was written again.
        assert any(at <= synced and at + n >= lost[0] for at, n in rewrites), rewrites
