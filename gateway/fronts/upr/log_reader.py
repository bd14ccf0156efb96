"""Reading a vbucket log's segment files: on the loop from the page cache, else in threads.

``read_disk`` opens the segments that may hold a seqno range and finds the
offsets on the loop (the sparse index), then reads ``READ_CHUNK`` bytes at a
time: on the loop when the page cache holds them (``pread_cached`` never
waits for the disk), else in a worker thread (I/O only, which releases the
GIL), at most ``DISK_READERS`` at once for all streams. The sink decodes
each chunk on the loop, a bounded slice of work between two waits. The
files stay open until the read is done, so a compaction replacing them
meanwhile changes nothing it reads. ``read_items`` is the same read done at
once on the loop, for tools and tests.
"""

from __future__ import annotations

import bisect
import os

import trio

from adapters.translate.log_records import LogItem
from gateway.fronts.upr.segments import (
    READ_CHUNK,
    DiskPlan,
    LogReadError,
    RecordSink,
    Segment,
    pread,
    pread_cached,
    read_planned,
    unreadable,
    walk_records,
)

DISK_READERS = 4
"""Threads reading logs from disk at once, for all streams: few threads, few
reads in flight (each a chunk of bytes; the decoding is done on the loop)."""
_readers: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("log_disk_readers")

Stop = tuple[Segment, int]
"""Where a read stopped: the segment and the offset after the last record walked."""


def _disk_readers() -> trio.CapacityLimiter:
    try:
        return _readers.get()
    except LookupError:
        limiter = trio.CapacityLimiter(DISK_READERS)
        _readers.set(limiter)
        return limiter


def _first(pair: tuple[int, int]) -> int:
    return pair[0]


def disk_plan(
    segments: list[Segment], after: int, upto: int, resume: Stop | None = None
) -> DiskPlan:
    """The segments that may hold ``after < seqno <= upto``, opened, each with the
    offset to start at (the sparse index, or ``resume``) and its published size."""
    plan = DiskPlan()
    try:
        for segment in segments:
            if segment.last <= after or not segment.size:
                continue
            if segment.first > upto:
                break
            index = bisect.bisect_right(segment.sparse, after, key=_first) - 1
            offset = segment.sparse[index][1] if index >= 0 else 0
            if resume is not None and resume[0] is segment:  # not a compacted stand-in
                offset = max(offset, resume[1])
            plan.parts.append((os.open(segment.path, os.O_RDONLY), offset, segment.size))
            plan.segments.append(segment)
    except BaseException:
        plan.close()
        raise
    return plan


def read_items(
    segments: list[Segment],
    after: int,
    upto: int,
    limit: int,
    max_bytes: int | None,
    vbucket: int,
) -> list[LogItem]:
    """The items on disk with ``after < by_seqno <= upto`` (see ``VbLog.read``), read on
    the calling thread."""
    for _attempt in range(3):
        try:
            plan = disk_plan(segments, after, upto)
        except FileNotFoundError:
            continue  # a compaction replaced a segment meanwhile: look again
        with plan:
            return read_planned(plan, after, upto, limit, max_bytes)
    raise RuntimeError(f"vbucket {vbucket}: log segments keep vanishing")


async def read_disk(
    segments: list[Segment],
    after: int,
    upto: int,
    sink: RecordSink,
    *,
    chunk: int = READ_CHUNK,
    resume: Stop | None = None,
) -> Stop | None:
    """Feed ``sink`` the records of ``segments`` from ``after`` (up to ``upto``) until it
    says the read is done or the log ends there (see the module).

    Returns where the read stopped (None: nothing read). A later read from the
    seqno of the last item fed, which the sink took to that record's end, may
    ``resume`` there instead of at the sparse index's record before it.
    """
    limiter = _disk_readers()
    to_thread = trio.to_thread.run_sync
    stop: Stop | None = None
    with disk_plan(segments, after, upto, resume) as plan:
        # Not abandoned on cancel: the files stay open until the thread is done.
        for (fd, offset, size), segment in zip(plan.parts, plan.segments, strict=True):
            want = chunk
            while offset < size:
                length = min(want, size - offset)
                if stop is not None:
                    await trio.lowlevel.checkpoint()  # a slice of work per chunk, at most
                data: bytes | memoryview | None = pread_cached(fd, offset, length)
                if data is None:  # from the disk: in a worker thread
                    data = await to_thread(pread, fd, offset, length, limiter=limiter)
                end, done = walk_records(data, offset, sink)
                stop = (segment, end)
                if done:
                    return stop
                if end == offset:
                    if want >= size - offset:
                        where = f"{segment.path.parent.name}/{segment.path.name}"
                        raise LogReadError(unreadable(where, offset, size))
                    want *= 2  # a record bigger than the chunk
                    continue
                want = chunk
                offset = end
    return stop
