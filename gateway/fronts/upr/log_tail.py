"""The latest published records of a vbucket log, kept in memory for streams that keep up.

One entry per write: (first item seqno, last item seqno, the framed records
as written to the segment file), at most ``limit`` bytes of them. Streams read
it as they read the disk (``walk_records`` into a sink: ``BatchCut`` frames
UPR messages from block bytes, ``LogItemSink`` makes ``LogItem``s). Bytes and
plain tuples of ints, not a ``LogItem`` per item: CPython's collector stops
tracking those, where hundreds of thousands of live named tuples would be
walked by every full collection, a pause for every connection.

A write the ingest framed for the stream that follows the log
(``adapters.translate.log_preframing``) is kept beside its records, in the
same byte budget, until that stream takes it: a read from the write's first
item by that stream's encoder (``BatchCut.adopt``) is the framed bytes, with
no walk of the records. A stream whose read starts inside a write is walked
to that write's end, so its next read starts at a framed one. A framed write
dropped unread (its stream fell behind the tail) sets ``unused``: the log then
stops framing until a stream reads the tail again.

Memory: a tail always may keep ``KEEP_BYTES`` (or its ``limit`` if smaller);
beyond that it grows up to its ``limit`` (``vblog.DEFAULT_TAIL_BYTES``: 8 MiB a
vbucket) only while the bytes all tails hold beyond their keep stay under
``SHARED_BYTES`` (64 MiB for the process, ``TailBudget``): past it, the tails
written least lately give back all they hold beyond their keep, oldest writes
first. So a backfill that goes one vbucket at a time, or a few live ones,
are served from memory, and 1024 vbuckets cost at most 1024 x 256 KiB + 64
MiB whatever the consumers do.
"""

from __future__ import annotations

import bisect
import weakref
from collections import OrderedDict

from adapters.translate.log_preframing import Framed
from adapters.translate.log_to_upr_fast import BatchCut, BatchEncoder
from gateway.fronts.upr.segments import RecordSink, walk_records

Chunk = tuple[int, int, bytes]
"""(first item seqno, last item seqno, the framed records of one write)."""
FramedWrite = tuple[int, BatchEncoder, Framed]
"""(first item seqno, the encoder it was framed for, its UPR messages) of one write."""


LOOK_BACK = 4
"""Writes ``LogTail.start`` steps back over before it bisects."""
KEEP_BYTES = 256 * 1024
"""Bytes a tail keeps whatever the others hold (at most its ``limit``)."""
SHARED_BYTES = 64 * 1024 * 1024
"""Bytes all tails of the process hold beyond their keep, at most."""


class TailBudget:
    """The bytes tails hold beyond their keep, and which were written least lately."""

    def __init__(self, limit: int = SHARED_BYTES) -> None:
        self.limit = limit
        self.total = 0
        self._extra: OrderedDict[int, tuple[weakref.ref[LogTail], int]] = OrderedDict()
        """By tail id, least lately written first: the tail and its bytes beyond its keep."""

    def grew(self, tail: LogTail) -> None:
        """``tail`` was written (its size changed): account for it, and trim the tails
        written least lately while all hold more than ``limit`` beyond their keep."""
        key = id(tail)
        extra = max(0, tail.size - tail.keep)
        entry = self._extra.pop(key, None)
        if entry is not None:
            self.total -= entry[1]
        if extra:
            self._extra[key] = (entry[0] if entry is not None else weakref.ref(tail), extra)
            self.total += extra
        while self.total > self.limit and self._extra:
            ref, held = self._extra.popitem(last=False)[1]
            self.total -= held
            other = ref()
            if other is not None:
                other.shrink(other.keep)

    def follow(self, tail: LogTail) -> None:
        """Forget ``tail``'s bytes once it is gone."""
        weakref.finalize(tail, self._gone, id(tail))

    def _gone(self, key: int) -> None:
        entry = self._extra.pop(key, None)
        if entry is not None:
            self.total -= entry[1]


BUDGET = TailBudget()


def _last(chunk: Chunk) -> int:
    return chunk[1]


class LogTail:
    __slots__ = ("__weakref__", "budget", "chunks", "encoder", "floor", "framed", "keep", "limit",
                 "size", "unused")  # fmt: skip

    def __init__(self, limit: int, floor: int = 0, budget: TailBudget | None = None) -> None:
        self.limit = limit
        self.keep = min(limit, KEEP_BYTES)
        """What this tail keeps whatever the others hold."""
        self.budget = budget if budget is not None else BUDGET
        if limit > self.keep:
            self.budget.follow(self)
        self.chunks: list[Chunk] = []
        """In seqno order."""
        self.size = 0
        """Bytes of the records and the framed writes held."""
        self.floor = floor
        """Every published item above this seqno is here."""
        self.framed: dict[int, Framed] = {}
        """Writes framed for ``encoder``, by their first item's seqno."""
        self.encoder: BatchEncoder | None = None
        self.unused = False
        """A framed write was dropped before its stream read it."""

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def holds(self, after: int) -> bool:
        """Whether a read from ``after`` is served from here."""
        return after >= self.floor and bool(self.chunks)

    def add(self, chunks: list[Chunk], framed: list[FramedWrite] | None = None) -> None:
        """Writes just published, in order (and those of them framed for a stream)."""
        tail = self.chunks
        tail += chunks
        for chunk in chunks:
            self.size += len(chunk[2])
        if framed:
            held = self.framed
            for first, encoder, messages in framed:
                if encoder is not self.encoder:  # another stream follows: the others go
                    self._forget(list(held))
                    self.encoder = encoder
                held[first] = messages
                self.size += len(messages[0])
        if self.size > self.limit:
            # Drop the older half at once (amortised O(1) per write); a write bigger
            # than the whole tail is read back from the file (the page cache).
            self._drop(max(1, len(tail) // 2))
        if self.limit > self.keep:
            self.budget.grew(self)

    def _drop(self, cut: int) -> None:
        """Drop the ``cut`` oldest writes."""
        tail = self.chunks
        self.floor = tail[cut - 1][1]
        self.size -= sum(len(c[2]) for c in tail[:cut])
        if self.framed:
            self.unused = self._forget([c[0] for c in tail[:cut]]) or self.unused
        del tail[:cut]

    def shrink(self, size: int) -> None:
        """Drop the oldest writes until the tail holds ``size`` bytes at most."""
        tail = self.chunks
        framed = self.framed
        over = self.size - size
        cut = 0
        while over > 0 and cut < len(tail):
            first, _last, data = tail[cut]
            messages = framed.get(first)
            over -= len(data) + (len(messages[0]) if messages is not None else 0)
            cut += 1
        if cut:
            self._drop(cut)

    def _forget(self, firsts: list[int]) -> bool:
        """Drop the framed writes of these first seqnos; whether there were any."""
        held = self.framed
        dropped = False
        for first in firsts:
            messages = held.pop(first, None)
            if messages is not None:
                self.size -= len(messages[0])
                dropped = True
        return dropped

    def drop_upto(self, seqno: int) -> None:
        """Forget the writes up to ``seqno`` (compaction rewrote that part of the log)."""
        tail = self.chunks
        cut = bisect.bisect_right(tail, seqno, key=_last)
        if cut:
            self.size -= sum(len(c[2]) for c in tail[:cut])
            self._forget([c[0] for c in tail[:cut]])
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
        start = self.start(after)
        if self.framed and start < len(tail) and type(sink) is BatchCut:
            first, last, _data = tail[start]
            if sink.encoder is self.encoder and not sink.items:
                if first > after:
                    # Its stream is here: taken, or walked for a read it would not fill.
                    messages = self.framed.pop(first, None)
                    if messages is not None:
                        self.size -= len(messages[0])
                        if sink.adopt(messages):
                            return
                elif start + 1 < len(tail) and tail[start + 1][0] in self.framed:
                    # Walked to the end of this write: the next read starts at a framed one.
                    sink.upto = min(sink.upto, last)
        for n in range(start, len(tail)):
            first, _last_seqno, data = tail[n]
            if first > upto or walk_records(data, 0, sink, verify=False)[1]:
                return
