"""The durable log of one vbucket: segments on disk, a small index, a failover log.

Theory of operation. Ingest feeds TAP messages to ``ingest``; the vbucket's
``TapToUpr`` assigns seqnos and the records are framed into a write buffer.
``write`` hands the buffer to the active segment file, ``sync`` fsyncs it
(the ingest calls it per the fsync policy, in a worker thread), and only
then ``publish`` makes the records visible to readers and wakes the
streams waiting for them: consumers are never offered what a crash could
take back, and the ingest acks TAP messages only after ``publish``.

Files (``state_dir/vb-NNNN/``): segments named by the first seqno they may
hold (``00000000000000000001.seg``), rolled at ``segment_bytes``, and
``meta.msgpack`` (failover log, seqno reservation, purge seqno, clean flag),
replaced atomically.

Opening replays every record into a fresh ``TapToUpr`` (index and phase),
builds a sparse seqno -> offset index per segment, and truncates a torn
tail. Continuity: a vbucket that restarts after a clean close, or after a
crash with an intact log and fsync on, continues its history. A torn tail,
or a crash with fsync "never", cannot prove that what consumers saw is all
still there: the next seqno then jumps past the last *reserved* seqno (the
meta file always reserves ahead of what was published, so seqnos are never
reused) and a new failover entry starts there.

Writers: the ingest and a takeover connection may both write one vbucket;
``lock`` is held from ``write`` to ``publish`` (see ``ingest.commit``), and
``publish`` exposes only what was handed to the file, never items fed
since, so nothing is readable before it is synced.

Memory: the index (key -> latest version), the sparse offsets, one write
buffer, and a tail of the latest published items (about ``tail_bytes`` of
keys and values) from which streams that keep up are served without
reading the disk; everything else stays on disk. ``disk_bytes`` is a
running total of the segment files.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import trio

from adapters.tap.events import TapStreamMessage
from adapters.translate.log_records import LogItem, LogRecord, from_row, to_row
from adapters.translate.tap_to_upr import TapToUpr
from gateway.node.failover import FailoverLog
from gateway.uprfront.segments import (
    HEADER_ROW,
    frame,
    fsync_dir,
    scan,
    scan_bytes,
    write_atomic,
)

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
SPARSE_EVERY = 64
RESERVE_STEP = 100_000
READ_CHUNK = 256 * 1024
FSYNC_POLICIES = ("always", "batch", "never")
DEFAULT_TAIL_BYTES = 256 * 1024


@dataclass
class Segment:
    path: Path
    first: int
    last: int = 0
    """Seqno of the last item in it (0: none yet)."""
    size: int = 0
    """Bytes readers may read (published)."""
    sparse: list[tuple[int, int]] = field(default_factory=list)
    """(seqno, offset) of every SPARSE_EVERY-th item."""
    count: int = 0


def _first(pair: tuple[int, int]) -> int:
    return pair[0]


def _seqno(item: LogItem) -> int:
    return item.by_seqno


def segment_name(first: int) -> str:
    return f"{first:020d}.seg"


class VbLog:
    def __init__(
        self,
        root: Path,
        vbucket: int,
        *,
        fsync: str = "batch",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        expiry_tolerance: float = 1.0,
        rng: random.Random | None = None,
        tail_bytes: int = DEFAULT_TAIL_BYTES,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {fsync!r}")
        self.vbucket = vbucket
        self.dir = root / f"vb-{vbucket:04d}"
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.translator = TapToUpr(vbucket, expiry_tolerance=expiry_tolerance)
        self.failover = FailoverLog(rng or random.Random())
        self.segments: list[Segment] = []
        self.reserved = 0
        self.purge_seqno = 0
        self.high_seqno = 0
        """Highest seqno published (readers see up to here)."""
        self.torn_bytes = 0
        self.continued = True
        """Whether opening proved the history continues (no new failover entry)."""
        self._file: BinaryIO | None = None
        self._buffer = bytearray()
        self._unsynced = False
        self._pending: list[tuple[int, int]] = []
        """(seqno, offset-in-buffer) of buffered items due in the sparse index."""
        self._pending_items = 0
        self._buffer_high = 0
        """Seqno of the last item in the buffer (0: none)."""
        self._written_size = 0
        self._written_high = 0
        """Seqno of the last item handed to the file: what ``publish`` may expose."""
        self.disk_bytes = 0
        """Bytes of every segment file, kept as the log grows (no stat calls)."""
        self.tail_bytes = tail_bytes
        self._tail: list[LogItem] = []
        """The latest published items, in seqno order: streams that keep up read
        them from here, not from disk (about ``tail_bytes`` of keys and values)."""
        self._tail_size = 0
        self._tail_floor = 0
        """Every published item above this seqno is in the tail."""
        self._unwritten: list[LogItem] = []
        self._unpublished: list[LogItem] = []
        self.lock = trio.Lock()
        """Held from ``write`` to ``publish``: whoever writes this vbucket (the
        ingest, a takeover connection) publishes only what it synced itself."""
        self._changed = trio.Event()
        self.items_total = 0
        self.compacted_path: Path | None = None

    # -- opening ---------------------------------------------------------------

    @property
    def meta_path(self) -> Path:
        return self.dir / "meta.msgpack"

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self._read_meta()
        torn = self._load_segments()
        t = self.translator
        if meta is not None:
            self.failover = FailoverLog(self.failover._rng, meta["failover"])
            self.reserved = int(meta["reserved"])
            self.purge_seqno = int(meta["purge_seqno"])
        proven = meta is not None and not torn and (meta["clean"] or self.fsync != "never")
        if meta is None and not self.segments:
            self.failover.add(0)
        elif not proven or not len(self.failover):
            # What consumers saw may be gone: never reuse a seqno they may hold.
            t.high_seqno = max(t.high_seqno, self.reserved)
            self.failover.add(t.high_seqno)
            self.continued = False
            log.warning(
                "vbucket %d: cannot prove the log continues (torn %d bytes, clean=%s): "
                "new history from seqno %d",
                self.vbucket,
                self.torn_bytes,
                None if meta is None else meta["clean"],
                t.high_seqno,
            )
        self.high_seqno = self._written_high = self._tail_floor = t.high_seqno
        self._reserve(self.high_seqno, force=True, clean=False)
        self._open_active()
        self.disk_bytes = sum(s.size for s in self.segments)

    def _read_meta(self) -> dict[str, Any] | None:
        try:
            data = self.meta_path.read_bytes()
        except FileNotFoundError:
            return None
        meta: dict[str, Any] = msgpack.unpackb(data, raw=False)
        return meta

    def _load_segments(self) -> bool:
        paths = sorted(self.dir.glob("*.seg"), key=lambda p: int(p.stem))
        torn = False
        covered = 0
        for path in paths:
            first = int(path.stem)
            if covered and first <= covered:
                # Left behind by a compaction that crashed before deleting it.
                path.unlink()
                continue
            segment = Segment(path, first)
            good = 0
            for offset, end, row in scan(path):
                good = end
                if row[0] == HEADER_ROW:
                    covered = max(covered, int(row[1]))
                    continue
                record = from_row(row)
                if isinstance(record, LogItem):
                    if record.by_seqno <= self.translator.high_seqno:
                        continue
                    self._index_item(segment, record.by_seqno, offset)
                self.translator.replay(record)
            size = path.stat().st_size
            if good < size:
                torn = True
                self.torn_bytes += size - good
                with open(path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
            segment.size = good
            self.segments.append(segment)
        return torn

    def _index_item(self, segment: Segment, seqno: int, offset: int) -> None:
        if segment.count % SPARSE_EVERY == 0:
            segment.sparse.append((seqno, offset))
        segment.count += 1
        segment.last = seqno

    def _open_active(self) -> None:
        if not self.segments or self.segments[-1].size >= self.segment_bytes:
            # Not the translator's high seqno: buffered items may be ahead of the file.
            first = self._written_high + 1
            path = self.dir / segment_name(first)
            path.touch()
            fsync_dir(self.dir)
            self.segments.append(Segment(path, first))
        self._file = open(self.segments[-1].path, "ab")  # noqa: SIM115 - kept open
        self._written_size = self.segments[-1].size

    def _write_meta(self, *, clean: bool) -> None:
        meta = {
            "failover": [list(e) for e in self.failover.entries],
            "reserved": self.reserved,
            "purge_seqno": self.purge_seqno,
            "clean": clean,
        }
        write_atomic(self.meta_path, msgpack.packb(meta, use_bin_type=True))

    def save_meta(self) -> None:
        self._write_meta(clean=False)

    def _reserve(self, upto: int, *, force: bool = False, clean: bool = False) -> None:
        if force or upto > self.reserved:
            self.reserved = max(self.reserved, upto + RESERVE_STEP)
            self._write_meta(clean=clean)

    # -- appending -------------------------------------------------------------

    def ingest(self, message: TapStreamMessage, now: float) -> list[LogRecord]:
        """Translate and buffer one TAP message; nothing is visible before ``publish``."""
        records = self.translator.feed(message, now)
        buffer = self._buffer
        for record in records:
            if type(record) is LogItem:
                # Only every SPARSE_EVERY-th item of a segment is indexed.
                if (self.segments[-1].count + self._pending_items) % SPARSE_EVERY == 0:
                    self._pending.append((record.by_seqno, len(buffer)))
                self._pending_items += 1
                self._buffer_high = record.by_seqno
                self._unwritten.append(record)
                self.items_total += 1
            buffer += frame(to_row(record))
        return records

    @property
    def dirty(self) -> bool:
        return bool(self._buffer) or self._unsynced

    def write(self) -> int:
        """Hand buffered records to the file (the OS); how many bytes.

        Call with ``lock`` held until ``publish``.
        """
        if not self._buffer:
            return 0
        assert self._file is not None
        segment = self.segments[-1]
        base = self._written_size
        size = len(self._buffer)
        self._file.write(self._buffer)
        self._file.flush()
        for seqno, offset in self._pending:
            segment.sparse.append((seqno, base + offset))
        if self._pending_items:
            segment.count += self._pending_items
            segment.last = self._buffer_high
            self._written_high = self._buffer_high
        self._written_size += size
        self.disk_bytes += size
        self._buffer.clear()
        self._pending.clear()
        self._pending_items = 0
        self._unpublished += self._unwritten
        self._unwritten.clear()
        self._unsynced = True
        return size

    def sync(self) -> None:
        """fsync the active segment (may run in a worker thread)."""
        if self._file is not None and self._unsynced:
            os.fsync(self._file.fileno())

    def publish(self) -> None:
        """Make what was written (and synced) readable, and wake waiting streams.

        Only what ``write`` handed to the file: items still in the buffer
        (fed since) have seqnos but are not on disk yet.
        """
        self._unsynced = False
        segment = self.segments[-1]
        segment.size = self._written_size
        if self._unpublished:
            self._to_tail(self._unpublished)
            self._unpublished = []
        high = self._written_high
        if high > self.reserved:
            self._reserve(high)
        if high != self.high_seqno:
            self.high_seqno = high
            self._wake()
        if segment.size >= self.segment_bytes:
            assert self._file is not None
            self._file.close()
            self._open_active()

    def _to_tail(self, items: list[LogItem]) -> None:
        tail = self._tail
        tail += items
        self._tail_size += sum(len(i.key) + len(i.value) for i in items)
        if self._tail_size > self.tail_bytes and len(tail) > 1:
            # Drop the older half at once: amortised O(1) per item.
            cut = len(tail) // 2
            self._tail_floor = tail[cut - 1].by_seqno
            self._tail_size -= sum(len(i.key) + len(i.value) for i in tail[:cut])
            del tail[:cut]

    def drop_tail_upto(self, seqno: int) -> None:
        """Forget cached items up to ``seqno`` (compaction rewrote that part of the log:
        reads of it go to the compacted segments)."""
        tail = self._tail
        cut = bisect.bisect_right(tail, seqno, key=_seqno)
        if cut:
            self._tail_size -= sum(len(i.key) + len(i.value) for i in tail[:cut])
            del tail[:cut]
        self._tail_floor = max(self._tail_floor, seqno)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_beyond(self, seqno: int) -> None:
        """Until ``high_seqno`` exceeds ``seqno`` (returns at once if it does)."""
        while self.high_seqno <= seqno:
            await self._changed.wait()

    def close(self) -> None:
        """Clean close: everything written is synced and the meta says so."""
        if self._file is None:
            return
        self.write()
        self.sync()
        self.publish()
        self._file.close()
        self._file = None
        self._write_meta(clean=True)

    def abandon(self) -> None:
        """Drop the file handle without the clean mark (a simulated crash in tests)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- reading ---------------------------------------------------------------

    def read(
        self, after: int, upto: int, limit: int, max_bytes: int | None = None
    ) -> list[LogItem]:
        """Published items with ``after < by_seqno <= upto``, at most ``limit``.

        ``max_bytes``: stop after the item that brings the keys and values
        read to this many bytes (at least one item is always returned).
        """
        upto = min(upto, self.high_seqno)
        out: list[LogItem] = []
        if after >= upto:
            return out
        if after >= self._tail_floor and self._tail:
            return self._read_tail(after, upto, limit, max_bytes)
        budget = [max_bytes if max_bytes is not None else -1]
        for _attempt in range(3):
            try:
                self._read_into(out, after, upto, limit, budget)
                return out
            except FileNotFoundError:
                # A compaction replaced the segment meanwhile: look again.
                after = out[-1].by_seqno if out else after
        raise RuntimeError(f"vbucket {self.vbucket}: log segments keep vanishing")

    def _read_tail(self, after: int, upto: int, limit: int, max_bytes: int | None) -> list[LogItem]:
        tail = self._tail
        start = bisect.bisect_right(tail, after, key=_seqno)
        stop = bisect.bisect_right(tail, upto, key=_seqno, lo=start)
        out = tail[start : min(stop, start + limit)]
        if max_bytes is not None:
            left = max_bytes
            for n, item in enumerate(out):
                left -= len(item.key) + len(item.value)
                if left <= 0:
                    return out[: n + 1]
        return out

    def _read_into(
        self, out: list[LogItem], after: int, upto: int, limit: int, budget: list[int]
    ) -> None:
        left = budget[0]
        for segment in list(self.segments):
            if segment.last <= after or not segment.size:
                continue
            if segment.first > upto:
                return
            index = bisect.bisect_right(segment.sparse, after, key=_first) - 1
            offset = segment.sparse[index][1] if index >= 0 else 0
            with open(segment.path, "rb") as f:
                want = READ_CHUNK
                while offset < segment.size:
                    f.seek(offset)
                    chunk = f.read(min(want, segment.size - offset))
                    end = offset
                    for _start, record_end, row in scan_bytes(chunk, offset):
                        end = record_end
                        if row[0] != 0:
                            continue
                        seqno = row[1]
                        if seqno <= after:
                            continue
                        if seqno > upto:
                            return
                        item = from_row(row)
                        assert type(item) is LogItem
                        out.append(item)
                        after = seqno
                        if len(out) >= limit:
                            return
                        if left >= 0:
                            left -= len(item.key) + len(item.value)
                            budget[0] = left
                            if left <= 0:
                                return
                    if end == offset:
                        if want >= segment.size - offset:
                            break  # nothing whole left (cannot happen once published)
                        want *= 2  # a record bigger than the chunk
                        continue
                    want = READ_CHUNK
                    offset = end

    # -- figures ---------------------------------------------------------------

    def bytes_on_disk(self) -> int:
        """Bytes of the segment files (a running total: no file system calls)."""
        return self.disk_bytes
