"""The durable log on its own: append, read, reopen, compaction, purge."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import pytest
import trio

from adapters import upr
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlags,
    TapMutation,
    TapOpaque,
)
from adapters.translate.log_records import LogItem
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from gateway.fronts.upr import compaction, log_reader
from gateway.fronts.upr import vblog as vblog_module
from gateway.fronts.upr.compaction import compact_log
from gateway.fronts.upr.ingest import commit
from gateway.fronts.upr.segments import READ_CHUNK, pread, pread_cached
from gateway.fronts.upr.vblog import VbLog

NOW = 1_700_000_000.0


def fill(vblog: VbLog, rounds: int, keys: int = 10, now: float = NOW) -> int:
    cas = 0
    vblog.ingest(TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM), now)
    vblog.ingest(TapOpaque(OpaqueCode.CLOSE_BACKFILL), now)
    for r in range(rounds):
        vblog.ingest(TapCheckpointStart(r + 1), now)
        for k in range(keys):
            cas += 1
            message = TapMutation(b"k%d" % k, b"v%d" % cas * 10, cas=cas, rev_seqno=r + 1,
                                  tap_flags=TapFlags.NETWORK_BYTE_ORDER)  # fmt: skip
            vblog.ingest(message, now)
        vblog.ingest(TapCheckpointEnd(r + 1), now)
        vblog.write()
        vblog.sync()
        vblog.publish()
    return cas


def latest(items: list[LogItem]) -> dict[bytes, tuple[int, bool]]:
    out = {}
    for i in items:
        out[i.key] = (i.cas, i.deleted)
    return out


async def test_compaction_keeps_latest_versions_and_survives_reopen(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path, 0, segment_bytes=4000)
    vblog.open()
    cas = fill(vblog, 30)
    vblog.ingest(TapDelete(b"k0", cas=cas + 1, rev_seqno=99), NOW)
    vblog.write()
    vblog.publish()
    before_items = vblog.read(0, 10**9, 10**6)
    assert len(vblog.segments) > 3
    size = vblog.bytes_on_disk()
    saved = await compact_log(vblog, NOW + 10, purge_interval=3600)
    assert saved > 0 and vblog.bytes_on_disk() < size
    after_items = vblog.read(0, 10**9, 10**6)
    assert latest(after_items) == latest(before_items)
    assert [i.by_seqno for i in after_items] == sorted({i.by_seqno for i in after_items})
    assert len(after_items) < len(before_items)
    # Still readable from any seqno: everything after it is there, latest versions.
    middle = before_items[len(before_items) // 2].by_seqno
    tail = vblog.read(middle, 10**9, 10**6)
    newer = latest([i for i in before_items if i.by_seqno > middle])
    assert latest(tail) == newer
    high, index, last_cp = (
        vblog.high_seqno,
        dict(vblog.translator.index),
        vblog.translator.last_closed_checkpoint,
    )
    vblog.close()
    again = VbLog(tmp_path, 0, segment_bytes=4000)
    again.open()
    assert again.continued and again.high_seqno == high
    assert again.translator.index == index and again.translator.last_closed_checkpoint == last_cp
    assert latest(again.read(0, 10**9, 10**6)) == latest(before_items)
    again.close()


async def test_old_tombstones_are_purged_and_raise_the_purge_seqno(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path, 0, segment_bytes=2000)
    vblog.open()
    cas = fill(vblog, 5)
    vblog.ingest(TapDelete(b"k1", cas=cas + 1, rev_seqno=50), NOW)
    tomb = vblog.translator.version(b"k1").seqno
    fill_more = fill(vblog, 10)
    assert fill_more
    await compact_log(vblog, NOW + 7200, purge_interval=3600)
    assert vblog.purge_seqno == 0  # k1 was written again later: nothing purged
    vblog.ingest(TapDelete(b"k2", cas=10**6, rev_seqno=60), NOW)
    tomb = vblog.translator.version(b"k2").seqno
    fill_other = [
        TapMutation(b"x%d" % i, b"y" * 100, cas=10**6 + i + 1, rev_seqno=1) for i in range(40)
    ]
    for m in fill_other:
        vblog.ingest(m, NOW)
    vblog.write()
    vblog.publish()
    assert vblog.segments[-1].first > tomb  # the tombstone sits in a sealed segment
    await compact_log(vblog, NOW + 7200, purge_interval=3600)
    assert vblog.purge_seqno == tomb and b"k2" not in vblog.translator.index
    assert b"k2" not in {i.key for i in vblog.read(0, 10**9, 10**6)}
    vblog.close()


def test_reopen_after_crash_with_fsync_never_starts_a_new_history(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path / "never", 0, fsync="never")
    vblog.open()
    fill(vblog, 2)
    high, uuid = vblog.high_seqno, vblog.failover.uuid
    vblog.abandon()
    again = VbLog(tmp_path / "never", 0, fsync="never")
    again.open()
    assert not again.continued
    assert again.failover.entries[1][0] == uuid
    assert again.high_seqno >= 100_000 > high  # past every seqno reserved before the crash
    again.close()


class SlowDisk(VbLog):
    """A log on a disk whose fsync takes a while; it checks every publish against it."""

    def __init__(self, root: Path, vbucket: int) -> None:
        super().__init__(root, vbucket)
        self.synced_size = 0
        self.unsynced_publishes: list[tuple[int, int]] = []

    def sync(self) -> None:
        covered = self.written_size  # what this fsync is sure to cover
        time.sleep(0.02)
        super().sync()
        self.synced_size = max(self.synced_size, covered)

    def publish(self, *, settle: bool = True) -> None:
        super().publish(settle=settle)
        if self.segments[-1].size > self.synced_size:
            self.unsynced_publishes.append((self.segments[-1].size, self.synced_size))


async def test_two_writers_of_one_vbucket_publish_only_what_is_synced(tmp_path: Path) -> None:
    """The ingest and a takeover connection commit the same vbucket at once."""
    vblog = SlowDisk(tmp_path, 0)
    vblog.open()
    vblog.ingest(TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM), NOW)

    async def writer(name: bytes, count: int) -> None:
        for i in range(count):
            message = TapMutation(name + b"%d" % i, b"v", cas=i + 1, rev_seqno=1,
                                  tap_flags=TapFlags.NETWORK_BYTE_ORDER)  # fmt: skip
            vblog.ingest(message, NOW)
            await commit({0: vblog}, sync=True)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, b"ingest-", 5)
        nursery.start_soon(writer, b"takeover-", 5)
    assert vblog.unsynced_publishes == []
    assert vblog.high_seqno == 10
    assert len(vblog.read(0, 100, 100)) == 10


def test_publish_exposes_only_written_items(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path, 0)
    vblog.open()
    fill(vblog, 1, keys=3)
    vblog.ingest(TapMutation(b"later", b"v", cas=99, rev_seqno=1), NOW)  # buffered only
    vblog.publish()
    assert vblog.high_seqno == 3 and vblog.translator.high_seqno == 4
    assert [i.key for i in vblog.read(0, 100, 100)] == [b"k0", b"k1", b"k2"]
    assert vblog.bytes_on_disk() == sum(p.stat().st_size for p in tmp_path.rglob("*.seg"))
    vblog.write()
    vblog.publish()
    assert vblog.high_seqno == 4
    assert vblog.bytes_on_disk() == sum(p.stat().st_size for p in tmp_path.rglob("*.seg"))


def test_reads_from_the_in_memory_tail_equal_reads_from_disk(tmp_path: Path) -> None:
    vblog = VbLog(tmp_path, 0, tail_bytes=1500, segment_bytes=2000)  # a few writes
    vblog.open()
    fill(vblog, 6, keys=7)
    assert vblog.tail and vblog.tail.floor > 0  # part cached, part evicted
    vblog.close()
    disk = VbLog(tmp_path, 0)
    disk.open()  # a fresh log holds nothing in memory: every read goes to disk
    assert not disk.tail
    high = vblog.high_seqno
    for after in range(high + 1):
        for limit, max_bytes in ((1000, None), (3, None), (1000, 25)):
            got = vblog.read(after, high, limit, max_bytes)
            assert got == disk.read(after, high, limit, max_bytes), (after, limit, max_bytes)
            assert got == disk.read(after, high, 1000)[: len(got)]
    disk.close()


async def test_the_tail_frames_what_the_disk_frames(tmp_path: Path) -> None:
    """A live stream's fast path frames UPR messages from the tail's record bytes
    (``read_memory``) as a stream behind it does from the file's: the same bytes."""
    vblog = VbLog(tmp_path, 0, tail_bytes=10**6)
    vblog.open()
    fill(vblog, 8, keys=9)
    high = vblog.high_seqno
    assert vblog.in_memory(0)
    for after in range(0, high, 5):
        for limit, budget in ((1, -1), (7, -1), (1000, 60), (1000, -1)):
            memory = BatchCut(BatchEncoder(upr.DCP, 1, 0), after, high, limit, budget)
            vblog.read_memory(after, high, memory)
            disk = BatchCut(BatchEncoder(upr.DCP, 1, 0), after, high, limit, budget)
            await vblog.read_disk(after, high, disk)
            assert memory.finish() == disk.finish(), (after, limit, budget)
    vblog.close()


def test_the_index_and_the_tail_hold_no_object_the_collector_walks(tmp_path: Path) -> None:
    """Per key and per item the log keeps only what CPython's collector does not track
    (plain tuples of ints, bytes): a full collection's pause does not grow with
    the keys or the items cached."""
    vblog = VbLog(tmp_path, 0, tail_bytes=10**6)
    vblog.open()
    fill(vblog, 20, keys=50)
    vblog.ingest(TapDelete(b"k1", cas=10**6, rev_seqno=99), NOW)
    vblog.write()
    vblog.publish()
    gc.collect()  # plain tuples are untracked by the first collection they survive
    index = vblog.translator.index
    assert len(index) == 50 and not any(gc.is_tracked(v) for v in index.values())
    assert vblog.tail and not any(gc.is_tracked(chunk) for chunk in vblog.tail.chunks)
    vblog.close()


async def test_a_reader_waits_while_a_compaction_swaps_segment_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the install of a compacted file and ``segments`` naming it, a read
    would use the old offsets on the new file (or a deleted file). A stream reads
    after ``segments_settled``, so it sees the log before or after, never between."""
    vblog = VbLog(tmp_path, 0, segment_bytes=20_000, tail_bytes=1)  # reads go to disk
    vblog.open()
    fill(vblog, 100)
    before = vblog.read(0, 10**9, 10**6)
    assert len(vblog.segments) > 2
    # A start deep in the first segment: its sparse index points past the start of the file.
    first = [i for i in before if i.by_seqno <= vblog.segments[0].last]
    middle = first[len(first) * 3 // 4].by_seqno
    expected = latest([i for i in before if i.by_seqno > middle])
    got: list[LogItem] = []
    reader_started = threading.Event()
    real_install = compaction._install

    async def reader() -> None:
        reader_started.set()
        await vblog.segments_settled()
        got.extend(vblog.read(middle, 10**9, 10**6))

    async with trio.open_nursery() as nursery:

        def install(tmp: Path, target: Path, doomed: list[Path]) -> None:
            real_install(tmp, target, doomed)  # files swapped; segments not yet
            trio.from_thread.run_sync(nursery.start_soon, reader)
            assert reader_started.wait(10)

        monkeypatch.setattr(compaction, "_install", install)
        assert await compact_log(vblog, NOW + 10, purge_interval=3600) > 0
    assert latest(got) == expected
    assert [i.by_seqno for i in got] == sorted({i.by_seqno for i in got})


@pytest.mark.parametrize("cached", [True, False])
async def test_disk_reads_in_a_worker_thread_equal_reads_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """``read_async`` reads what the page cache holds on the loop, the rest in a
    worker thread: the same items as ``read`` either way."""
    if not cached:
        monkeypatch.setattr(log_reader, "pread_cached", lambda *_: None)
    vblog = VbLog(tmp_path, 0, tail_bytes=300, segment_bytes=2000)
    vblog.open()
    fill(vblog, 6, keys=7)
    vblog.close()
    disk = VbLog(tmp_path, 0)
    disk.open()  # nothing in memory: every read goes to disk
    assert len(disk.segments) >= 2 and not disk.in_memory(0)
    high = disk.high_seqno
    for after in range(high + 1):
        for upto in (high, after + 5):
            for limit, max_bytes in ((1000, None), (3, None), (1000, 25)):
                got = await disk.read_async(after, upto, limit, max_bytes)
                assert got == disk.read(after, upto, limit, max_bytes), (after, upto, limit)
    disk.close()


async def test_a_disk_read_in_flight_reads_the_files_it_opened_while_a_compaction_swaps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_async`` opens the files and finds the offsets on the loop, then reads in a
    thread: a compaction replacing and deleting those files meanwhile changes nothing
    it reads (the open files are the old ones)."""
    vblog = VbLog(tmp_path, 0, segment_bytes=20_000, tail_bytes=1)  # reads go to disk
    vblog.open()
    fill(vblog, 100)
    before = vblog.read(0, 10**9, 10**6)
    assert len(vblog.segments) > 2
    first = [i for i in before if i.by_seqno <= vblog.segments[0].last]
    middle = first[len(first) * 3 // 4].by_seqno
    planned = threading.Event()
    compacted = threading.Event()
    real_read = log_reader.pread

    def held_read(*args: int) -> bytes:
        planned.set()
        assert compacted.wait(10)
        return real_read(*args)

    monkeypatch.setattr(log_reader, "pread", held_read)
    monkeypatch.setattr(log_reader, "pread_cached", lambda *_: None)  # not in the page cache
    got: list[LogItem] = []

    async def reader() -> None:
        await vblog.segments_settled()
        got.extend(await vblog.read_async(middle, 10**9, 10**6))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.to_thread.run_sync(planned.wait)
        assert await compact_log(vblog, NOW + 10, purge_interval=3600) > 0
        compacted.set()
    assert got == [i for i in before if i.by_seqno > middle]


async def test_a_failed_fsync_of_served_records_writes_the_same_bytes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fsync batch serves records before their fsync. When it fails, the kernel may
    have dropped those pages (here: the file cut back to what was synced); what
    consumers saw stays served, and the next commit writes the same bytes at the same
    offsets, so the log that becomes durable holds those records with those seqnos."""
    vblog = VbLog(tmp_path, 0)
    vblog.open()
    fill(vblog, 1)
    synced = vblog.segments[-1].size
    for i in range(5):
        vblog.ingest(TapMutation(b"served-%d" % i, b"v", cas=100 + i, rev_seqno=1), NOW)
    real_sync = VbLog.sync

    def failing_sync(log: VbLog) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(VbLog, "sync", failing_sync)
    with pytest.raises(vblog_module.LogWriteError, match="written again with the same seqnos"):
        await commit({0: vblog}, sync=True, early=True)
    served = vblog.read(0, 10**9, 10**6)
    assert [i.key for i in served[-5:]] == [b"served-%d" % i for i in range(5)]
    assert vblog.dirty and not vblog.unsynced
    with open(vblog.segments[-1].path, "r+b") as f:
        f.truncate(synced)  # the pages the failed fsync dropped
    monkeypatch.setattr(VbLog, "sync", real_sync)
    await commit({0: vblog}, sync=True, early=True)
    assert not vblog.dirty and vblog.read(0, 10**9, 10**6) == served
    vblog.close()
    again = VbLog(tmp_path, 0)
    again.open()
    assert again.continued and again.read(0, 10**9, 10**6) == served
    again.close()


async def test_a_disk_read_resumed_where_the_last_one_stopped_frames_the_same(
    tmp_path: Path,
) -> None:
    """A stream's next disk read may start after the last record its batch took
    (``read_disk``'s ``resume``) instead of at the sparse index's record: the same
    batches either way, for any item and byte limit."""
    vblog = VbLog(tmp_path, 0, segment_bytes=20_000, tail_bytes=1)  # reads go to disk
    vblog.open()
    fill(vblog, 60)
    high = vblog.high_seqno
    assert len(vblog.segments) > 2

    async def batches(limit: int, budget: int, resuming: bool) -> list[bytes]:
        encoder = BatchEncoder(upr.DCP, 1, 0)
        out: list[bytes] = []
        after, resume = 0, None
        while after < high:
            cut = BatchCut(encoder, after, high, limit, budget)
            start = resume[1:] if resume is not None and resume[0] == after else None
            stop = await vblog.read_disk(after, high, cut, resume=start)
            encoded = cut.finish()
            assert encoded.items
            out.append(encoded.data)
            after = encoded.last
            resume = (after, *stop) if resuming and stop is not None and cut.whole else None
        return out

    for limit in (1, 7, 64, 1000):
        for budget in (-1, 50, 3000):
            assert await batches(limit, budget, True) == await batches(limit, budget, False)
    vblog.close()


def test_a_read_from_the_page_cache_gives_all_the_bytes_or_none(tmp_path: Path) -> None:
    """``pread_cached`` (run on the loop) never returns part of a read: a short read
    (past the end, or pages not cached) goes to the worker thread whole."""
    path = tmp_path / "segment"
    path.write_bytes(bytes(range(256)) * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pread_cached(fd, 10, 1000)
        assert got is None or got[:] == pread(fd, 10, 1000)
        assert pread_cached(fd, 25_000, 1000) is None  # 600 bytes there
    finally:
        os.close(fd)


def test_reads_from_the_page_cache_reuse_one_buffer_and_give_each_read_its_bytes(
    tmp_path: Path,
) -> None:
    """``pread_cached`` reads into one kept buffer per thread (a map per read cost
    page faults): each read's view holds that read's bytes, a read bigger than the
    buffer gets a bigger one, and a smaller one after it still sees only its own."""
    path = tmp_path / "segment"
    data = os.urandom(3 * READ_CHUNK)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, size in ((0, 1000), (7, 5000), (0, 2 * READ_CHUNK + 5), (3, 10), (0, 0)):
            got = pread_cached(fd, offset, size)
            if got is None:  # no RWF_NOWAIT here, or the pages are not cached
                continue
            assert len(got) == size
            assert bytes(got) == data[offset : offset + size]
    finally:
        os.close(fd)
