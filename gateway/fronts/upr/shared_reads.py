"""Disk reads framed once for every stream at the same place of the same log.

Theory of operation. Consumers that backfill the same vbucket together
(several readers of one bucket, a cluster's replicas) ask for the same
batches: the same log, from the same seqno, up to the same seqno, with the
same settings. A disk read and its framing (``log_to_upr_fast.BatchCut``)
cost far more than the write of their bytes, and the gateway has one core,
so framing each batch once for all of them is what lets several consumers
together go faster than one.

A stream on the fast path asks ``SharedReads.take`` before its own read:

- a batch framed within the last ``SHARED_BYTES`` for the same key (log,
  segment the read starts in, start and end seqnos, item limit, dialect and
  consumer settings) is reused when the read would have cut it the same way:
  its keys and values stayed under the room the stream may read now, or it
  was cut at exactly that room. Only the opaque in each frame's header
  differs between streams: the frames are kept as the pieces between the
  opaque fields, joined with the stream's opaque (one ``bytes.join``);
- a batch another stream is reading right now is waited for (``reading``),
  so streams that ask together make one read, not one each; the reader
  publishes it (``put``) before its own send, so a slow consumer never holds
  up the others;
- else the stream reads as before, and publishes what it framed (reads of
  the in-memory tail too, with ``TAIL`` for their segment), kept for
  the other live streams of the log that are not past its start (``wanted``):
  once they all took it, it goes. A stream that comes later reads the disk
  itself, so what the disk holds now is what it gets (a damaged block is
  found, not hidden by what was framed before the damage).

The key holds the segment object the read starts in: a compaction replaces
it, so a batch framed before never stands in for a read after. A log set
aside or re-fetched is a new ``VbLog``: its id is in the key, and the entry
checks it is still that log. Entries are dropped oldest first once their
bytes pass ``SHARED_BYTES``: memory stays bounded whatever the consumers do.
"""

from __future__ import annotations

import enum
import struct
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Union

import trio

from adapters.translate.log_to_upr_fast import BatchEncoder, EncodedBatch
from adapters.upr.dialect import Dialect

if TYPE_CHECKING:
    from gateway.fronts.upr.segments import Segment
    from gateway.fronts.upr.vblog import VbLog

SHARED_BYTES = 16 * 1024 * 1024
"""Framed bytes kept for other streams to reuse (for the whole process)."""

_BODY_LENGTH = struct.Struct(">I").unpack_from
_OPAQUE = struct.Struct(">I").pack

Key = tuple[int, int, int, int, int, int, bool, bool]


class TailMark(enum.Enum):
    """Stands for the segment of a batch read from the in-memory tail (which a
    compaction only drops), so a key's segment is a ``Segment`` or this mark."""

    TAIL = "tail"


TAIL = TailMark.TAIL
ReadFrom = Union["Segment", TailMark]
"""Where a batch was read from: a segment on disk or the in-memory tail."""
Stop = tuple["Segment", int]


class _Entry:
    __slots__ = ("asked", "by_left", "encoded", "kv_bytes", "log", "opaque", "pieces",
                 "segment", "stop", "wanted", "whole")  # fmt: skip

    def __init__(
        self,
        log: VbLog,
        segment: ReadFrom,
        encoded: EncodedBatch,
        opaque: int,
        stop: Stop | None,
        whole: bool,
        asked: int,
        left: int,
    ) -> None:
        self.log = weakref.ref(log)
        self.segment: ReadFrom = segment
        self.encoded = encoded
        self.opaque = opaque
        self.pieces: list[bytes] | None = None
        self.stop = stop
        self.whole = whole
        self.asked = asked
        self.kv_bytes = asked - left
        self.by_left = left <= 0
        """Cut by the room it was read with: only a read with that same room cuts it so."""
        self.wanted = 0
        """Streams still behind it (at most): it goes once they took it."""

    def size(self) -> int:
        return len(self.encoded.data) * (1 if self.pieces is None else 2)

    def fits(self, asked: int) -> bool:
        """Whether a read with ``asked`` bytes of room cuts the same batch."""
        return asked == self.asked if self.by_left else asked > self.kv_bytes

    def framed(self, opaque: int) -> EncodedBatch:
        if opaque == self.opaque:
            return self.encoded
        if self.pieces is None:
            self.pieces = _pieces(self.encoded.data)
        return self.encoded._replace(data=_OPAQUE(opaque).join(self.pieces))


def _pieces(data: bytes) -> list[bytes]:
    """``data``'s frames cut around each header's opaque field (bytes 12-15)."""
    pieces = []
    start = offset = 0
    size = len(data)
    while offset < size:
        pieces.append(data[start : offset + 12])
        start = offset + 16
        offset += 24 + _BODY_LENGTH(data, offset + 8)[0]
    pieces.append(data[start:])
    return pieces


class Shared:
    """One framed batch for a stream: the bytes with its opaque, where the read stopped."""

    __slots__ = ("encoded", "stop", "whole")

    def __init__(self, encoded: EncodedBatch, stop: Stop | None, whole: bool) -> None:
        self.encoded = encoded
        self.stop = stop
        self.whole = whole


class SharedReads:
    """The batches framed lately, by key (see the module docstring)."""

    def __init__(self, limit: int = SHARED_BYTES) -> None:
        self.limit = limit
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._reading: dict[Key, trio.Event] = {}

    @staticmethod
    def key(
        vblog: VbLog, after: int, upto: int, limit: int, dialect: Dialect, encoder: BatchEncoder
    ) -> tuple[Key, Segment] | None:
        """The key of a disk read from ``after`` up to ``upto`` (None: no segment holds it)."""
        for segment in vblog.segments:
            if segment.last > after and segment.size:
                key = (id(vblog), id(segment), after, min(upto, vblog.high_seqno), limit,
                       id(dialect), encoder.expiry_opcode, encoder.delete_times)  # fmt: skip
                return key, segment
        return None

    @staticmethod
    def tail_key(
        vblog: VbLog, after: int, upto: int, limit: int, dialect: Dialect, encoder: BatchEncoder
    ) -> Key:
        """The key of a read of the in-memory tail (``TAIL`` stands for its segment)."""
        return (id(vblog), 0, after, min(upto, vblog.high_seqno), limit, id(dialect),
                encoder.expiry_opcode, encoder.delete_times)  # fmt: skip

    def take(
        self, key: Key, vblog: VbLog, segment: ReadFrom, asked: int, opaque: int
    ) -> Shared | None:
        entry = self._entries.get(key)
        if entry is None or entry.log() is not vblog or entry.segment is not segment:
            return None
        if not entry.fits(asked):
            return None
        self.hits += 1
        before = entry.size()
        shared = Shared(entry.framed(opaque), entry.stop, entry.whole)
        entry.wanted -= 1
        if entry.wanted <= 0:  # every stream that was behind it took it
            del self._entries[key]
            self.bytes -= before
        else:
            self._grown(entry.size() - before)  # its pieces, cut at the first other opaque
        return shared

    def reading(self, key: Key) -> trio.Event | None:
        """Set once the stream reading this batch now has published it (or failed)."""
        return self._reading.get(key)

    def begin(self, key: Key) -> None:
        self.misses += 1
        self._reading[key] = trio.Event()

    def end(self, key: Key) -> None:
        event = self._reading.pop(key, None)
        if event is not None:
            event.set()

    def put(
        self,
        key: Key,
        vblog: VbLog,
        segment: ReadFrom,
        encoded: EncodedBatch,
        opaque: int,
        stop: Stop | None,
        whole: bool,
        asked: int,
        left: int,
        wanted: int,
    ) -> None:
        """Keep a batch for the ``wanted`` other streams that have yet to read it."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size()
        if wanted <= 0:
            return
        entry = _Entry(vblog, segment, encoded, opaque, stop, whole, asked, left)
        entry.wanted = wanted
        self._entries[key] = entry
        self._grown(entry.size())

    def _grown(self, size: int) -> None:
        self.bytes += size
        while self.bytes > self.limit and self._entries:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size()


_shared: trio.lowlevel.RunVar[SharedReads] = trio.lowlevel.RunVar("shared_reads")


def shared_reads() -> SharedReads:
    try:
        return _shared.get()
    except LookupError:
        shared = SharedReads()
        _shared.set(shared)
        return shared
