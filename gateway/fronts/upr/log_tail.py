"""The latest published records of a vbucket log, kept in memory for streams that keep up.

One entry per write: (first item seqno, last item seqno, the framed records
as written to the segment file), about ``limit`` bytes of them. Streams read
it as they read the disk (``walk_records`` into a sink: ``BatchCut`` frames
UPR messages from block bytes, ``LogItemSink`` makes ``LogItem``s). Bytes and
plain tuples of ints, not a ``LogItem`` per item: CPython's collector stops
tracking those, where hundreds of thousands of live named tuples would be
walked by every full collection, a pause for every connection.
"""

from __future__ import annotations

import bisect

from gateway.fronts.upr.segments import RecordSink, walk_records

Chunk = tuple[int, int, bytes]
"""(first item seqno, last item seqno, the framed records of one write)."""


LOOK_BACK = 4
"""Writes ``LogTail.start`` steps back over before it bisects."""


def _last(chunk: Chunk) -> int:
    return chunk[1]


class LogTail:
    __slots__ = ("chunks", "floor", "limit", "size")

    def __init__(self, limit: int, floor: int = 0) -> None:
        self.limit = limit
        self.chunks: list[Chunk] = []
        """In seqno order."""
        self.size = 0
        self.floor = floor
        """Every published item above this seqno is here."""

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def holds(self, after: int) -> bool:
        """Whether a read from ``after`` is served from here."""
        return after >= self.floor and bool(self.chunks)

    def add(self, chunks: list[Chunk]) -> None:
        """Writes just published, in order."""
        tail = self.chunks
        tail += chunks
        for chunk in chunks:
            self.size += len(chunk[2])
        if self.size > self.limit:
            # Drop the older half at once (amortised O(1) per write); a write bigger
            # than the whole tail is read back from the file (the page cache).
            cut = max(1, len(tail) // 2)
            self.floor = tail[cut - 1][1]
            self.size -= sum(len(c[2]) for c in tail[:cut])
            del tail[:cut]

    def drop_upto(self, seqno: int) -> None:
        """Forget the writes up to ``seqno`` (compaction rewrote that part of the log)."""
        tail = self.chunks
        cut = bisect.bisect_right(tail, seqno, key=_last)
        if cut:
            self.size -= sum(len(c[2]) for c in tail[:cut])
            del tail[:cut]
        self.floor = max(self.floor, seqno)

    def start(self, after: int) -> int:
        """Index of the first write with an item beyond ``after``. A stream that keeps up
        wants the last write or few: looked for from the end first (a bisect with a
        key function cost about as much as framing the item)."""
        tail = self.chunks
        n = len(tail)
        stop = n - LOOK_BACK
        while n > stop:
            if n == 0 or tail[n - 1][1] <= after:
                return n
            n -= 1
        return bisect.bisect_right(tail, after, 0, n, key=_last)

    def read(self, after: int, upto: int, sink: RecordSink) -> None:
        """Feed ``sink`` the records from ``after`` until it says the read is done or
        an item is beyond ``upto``."""
        tail = self.chunks
        for n in range(self.start(after), len(tail)):
            first, _last_seqno, data = tail[n]
            if first > upto or walk_records(data, 0, sink, verify=False)[1]:
                return
