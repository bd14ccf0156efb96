"""Reading a vbucket log (``VbLog``'s side its streams see): what is published, from
the in-memory tail or the segment files, and being woken when more is.

Readers see items up to ``high_seqno``, which ``VbLog.publish`` raises (and
then wakes them); the latest writes come from the tail (``log_tail``), older
ones from disk (``log_reader``, off the loop). While a compaction swaps segment
files, ``segments`` holds the old offsets: disk reads wait for the swap to end.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from adapters.translate.log_records import LogItem
from gateway.fronts.upr import log_reader
from gateway.fronts.upr.log_tail import LogTail
from gateway.fronts.upr.segments import READ_CHUNK, LogItemSink, RecordSink, Segment


class LogReads:
    """The reading half of ``vblog.VbLog`` (which sets these attributes)."""

    vbucket: int
    segments: list[Segment]
    high_seqno: int
    """Highest seqno published (readers see up to here)."""
    tail: LogTail
    _swapping: trio.Event | None
    _changed: trio.Event | None
    """Set when ``high_seqno`` grows, for the tasks in ``wait_beyond`` (None: none waits)."""
    _watchers: list[Callable[[], None]]

    def _wake(self) -> None:
        changed = self._changed
        if changed is not None:  # only when a task waits: not one Event per publish
            self._changed = None
            changed.set()
        for wake in self._watchers:
            wake()

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` (at once, on the loop) whenever ``high_seqno`` grows, until the
        returned call stops it: a connection's one serving task hears of every
        vbucket it follows without a task waiting per stream."""
        self._watchers.append(wake)
        return lambda: self._watchers.remove(wake)

    async def wait_beyond(self, seqno: int) -> None:
        """Until ``high_seqno`` exceeds ``seqno`` (returns at once if it does)."""
        while self.high_seqno <= seqno:
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    def begin_segment_swap(self) -> None:
        """A compaction is about to replace segment files: disk reads must wait."""
        self._swapping = trio.Event()

    @property
    def swapping(self) -> bool:
        return self._swapping is not None

    def end_segment_swap(self) -> None:
        """``segments`` describes the files on disk again."""
        swapping, self._swapping = self._swapping, None
        if swapping is not None:
            swapping.set()

    async def segments_settled(self) -> None:
        """Wait until no compaction is swapping files. A reader calls it before
        ``read`` (with no checkpoint between): while files are swapped,
        ``segments`` still holds the old offsets, and a read could come back
        short and be taken for a gap."""
        while (swapping := self._swapping) is not None:
            await swapping.wait()

    def read(
        self, after: int, upto: int, limit: int, max_bytes: int | None = None
    ) -> list[LogItem]:
        """Published items with ``after < by_seqno <= upto``, at most ``limit``.

        ``max_bytes``: stop after the item that brings the keys and values
        read to this many bytes (at least one item is always returned).
        """
        upto = min(upto, self.high_seqno)
        if after >= upto:
            return []
        if self.tail.holds(after):
            return self._read_tail(after, upto, limit, max_bytes)
        return log_reader.read_items(self.segments, after, upto, limit, max_bytes, self.vbucket)

    def in_memory(self, after: int) -> bool:
        """Whether a read from ``after`` is served from the in-memory tail (or is empty)."""
        return after >= self.high_seqno or self.tail.holds(after)

    async def read_async(
        self, after: int, upto: int, limit: int, max_bytes: int | None = None
    ) -> list[LogItem]:
        """``read``, with what must come from disk read by ``read_disk``. Call it right
        after ``segments_settled``, with no checkpoint between."""
        upto = min(upto, self.high_seqno)
        if after >= upto:
            return []
        if self.tail.holds(after):
            return self._read_tail(after, upto, limit, max_bytes)
        out: list[LogItem] = []
        left = max_bytes if max_bytes is not None else -1
        await self.read_disk(after, upto, LogItemSink(out, after, upto, limit, left))
        return out

    async def read_disk(
        self,
        after: int,
        upto: int,
        sink: RecordSink,
        *,
        chunk: int = READ_CHUNK,
        resume: tuple[Segment, int] | None = None,
    ) -> tuple[Segment, int] | None:
        """Feed ``sink`` the records on disk from ``after`` (up to ``upto``: what is
        published now) until it says the read is done or the log ends there
        (``log_reader.read_disk``: the bytes off the loop unless the page cache
        holds them, decoded here a chunk at a time). Call it right after
        ``segments_settled``, with no checkpoint between.

        Returns where the read stopped (None: nothing read): the segment and the
        offset after the last record walked. A later read from the seqno of the
        last item fed, which the sink took to that record's end, may ``resume``
        there instead of at the sparse index's record before it.
        """
        upto = min(upto, self.high_seqno)
        if after >= upto:
            return None
        return await log_reader.read_disk(
            self.segments, after, upto, sink, chunk=chunk, resume=resume
        )

    def _read_tail(self, after: int, upto: int, limit: int, max_bytes: int | None) -> list[LogItem]:
        out: list[LogItem] = []
        left = max_bytes if max_bytes is not None else -1
        self.read_memory(after, upto, LogItemSink(out, after, upto, limit, left))
        return out

    def read_memory(self, after: int, upto: int, sink: RecordSink) -> None:
        """Feed ``sink`` the tail's records from ``after`` (up to ``upto``) until it says
        the read is done, as ``read_disk`` feeds it the file's. Only when ``in_memory``."""
        self.tail.read(after, min(upto, self.high_seqno), sink)
