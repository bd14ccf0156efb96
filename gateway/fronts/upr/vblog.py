"""The durable log of one vbucket: segments on disk, a small index, a failover log.

Theory of operation. Ingest feeds TAP messages to ``ingest``; the vbucket's
``TapToUpr`` assigns seqnos and the records are framed into a write buffer.
``write`` hands the buffer to the active segment file, ``publish`` makes
the records visible to readers and wakes the streams waiting for them,
``sync`` fsyncs the file (in a worker thread) and ``settle`` forgets the
bytes it covered. With fsync "batch" the ingest publishes right after the
write (``write_early``), before the fsync, as ep-engine 3.0 serves DCP
streams from memory before its flusher persists them; with "always" (and
for a takeover connection) it publishes only after the fsync. Either way
the ingest acks TAP messages only after their fsync returned, so nothing
the TAP node considers delivered is lost; a crash may take back records a
consumer was served, and the log then opens with a new failover entry at
its proven end (below), so that consumer rolls back.

Files (``state_dir/vb-NNNN/``): segments named by the first seqno they may
hold (``00000000000000000001.seg``), rolled at ``segment_bytes``, and
``meta.msgpack`` (failover log, seqno reservation, purge seqno, clean flag,
the list of segments, a pending re-fetch), crc-framed and replaced
atomically whenever a segment is created and before a compaction deletes
any.

Failed writes (``segment_file``): a failed append is cut back and its
buffer kept; after a failed fsync (``unwrite``) the unpublished records go
back to the buffer and the published ones are written again as they are,
seqnos included. Nothing of the batch is acked either way.

Opening proves the log on disk or sets it aside and starts over
(``log_open``); the history it continues or begins is ``log_history``'s.

Writers: the ingest and a takeover connection may both write one vbucket;
a committer that publishes only synced records holds ``lock`` from
``write`` to ``publish`` (see ``commit.commit``; ``write_early`` skips a
locked log), and ``publish`` exposes only what was handed to the file,
never items fed since. A segment rolls only when all of it is settled and
no fsync of it is in flight (``syncing``).

Modules: the write buffer (``write_buffer``: records framed, blocks and
sparse entries due) and the reads (``log_reads``: tail, disk, wake-ups).

Memory: the index (key -> latest version), the sparse offsets, one write
buffer, the last written and not yet published batch, and a tail of the
latest published writes (256 KiB, up to ``tail_bytes`` within the budget all
tails share: ``log_tail``) from which streams that keep up are served without
reading the disk, each write with its UPR messages when the ingest framed them
for the stream that follows the log (``log_preframing``); everything else
stays on disk. ``disk_bytes`` is a running total of the segment files. The
index and the tail hold bytes and plain tuples of ints only, which the
garbage collector does not walk.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from adapters.tap.events import TapStreamMessage
from adapters.translate.log_history import RESERVE_STEP, LogHistory
from adapters.translate.log_records import LogItem, LogMark, LogRecord
from adapters.translate.log_to_upr_fast import BatchCut
from adapters.translate.tap_to_upr import TapToUpr
from adapters.upr.failover_log import FailoverLog
from gateway.fronts.upr.fsync_epoch import FsyncEpoch
from gateway.fronts.upr.log_open import adopt, start_over
from gateway.fronts.upr.log_reads import LogReads
from gateway.fronts.upr.log_tail import Chunk, FramedWrite, LogTail
from gateway.fronts.upr.proof import (
    META_NAME,
    Meta,
    Problem,
    VbProof,
    prove_vbucket,
)
from gateway.fronts.upr.segment_file import LogWriteError, SegmentFile
from gateway.fronts.upr.segments import (
    SPARSE_EVERY,
    RecordSink,
    Segment,
    segment_name,
)
from gateway.fronts.upr.write_buffer import WriteBuffer
from gateway.runtime.files import fsync_dir, write_atomic

__all__ = ["RESERVE_STEP", "SPARSE_EVERY", "LogWriteError", "Segment", "VbLog", "segment_name"]

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
FSYNC_POLICIES = ("always", "batch", "never")
DEFAULT_TAIL_BYTES = 8 * 1024 * 1024
"""A vbucket's in-memory tail at most; beyond 256 KiB only within the process's budget
for all tails (``log_tail``)."""


class VbLog(LogReads):
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
        self.root = root
        self.vbucket = vbucket
        self.dir = root / f"vb-{vbucket:04d}"
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.expiry_tolerance = expiry_tolerance
        self.translator = TapToUpr(vbucket, expiry_tolerance=expiry_tolerance)
        self._rng = rng or random.Random()
        self.history = LogHistory(self._rng)
        """Failover log, reservation, purge seqno (``log_history``, no I/O)."""
        self.segments: list[Segment] = []
        self.high_seqno = 0
        """Highest seqno published (readers see up to here)."""
        self.torn_bytes = 0
        self.problems: list[Problem] = []
        """Why opening could not prove the log (empty: proven)."""
        self.set_aside: Path | None = None
        """Where opening moved the log it could not prove."""
        self.on_reserve: Callable[[VbLog], None] | None = None
        """Called after the reservation moved up, before any seqno above the old one
        is published (the log set records it in its manifest)."""
        self.doomed: set[Path] = set()
        """Segments a compaction is about to delete: the meta no longer lists them."""
        self._swapping: trio.Event | None = None
        """Set while a compaction swaps segment files under ``segments``."""
        self.file = SegmentFile(vbucket)
        """The active segment file: appends, fsyncs, what a failure takes back."""
        self.buffer = WriteBuffer()
        """Records framed and not yet handed to the file (``write_buffer``)."""
        self._written_high = 0
        """Seqno of the last item handed to the file: what ``publish`` may expose."""
        self.disk_high = 0
        """Where the next start finds the log ending: the last item handed to the file,
        or (none since it opened) its proof's end or newest history's start. A clean
        close records it; not ``high_seqno``, which an unclean open moves past the
        reservation before any item is there (``log_open.adopt``)."""
        self._mark = (0, 0, 0)
        """(sparse entries, count, last) of the active segment at the last publish."""
        self.disk_bytes = 0
        """Bytes of every segment file, kept as the log grows (no stat calls)."""
        self.tail_bytes = tail_bytes
        self.tail = LogTail(tail_bytes)
        """The latest published writes: streams that keep up read them from here."""
        self._unpublished: list[Chunk] = []
        """Writes of items handed to the file, not yet published."""
        self._framed: list[FramedWrite] = []
        """Those of them framed for the stream that follows (``log_preframing``)."""
        self.lock = trio.Lock()
        """Held from ``write`` to ``publish``: whoever writes this vbucket (the
        ingest, a takeover connection) publishes only what it synced itself."""
        self.handing_over = False
        """A takeover is handing this vbucket over: every committer publishes only
        synced records of it (``commit``), ``write_early`` skips it."""
        self._changed: trio.Event | None = None
        self._watchers: list[Callable[[], None]] = []
        self.compacted_path: Path | None = None

    # -- opening ---------------------------------------------------------------

    @property
    def failover(self) -> FailoverLog:
        return self.history.failover

    @property
    def reserved(self) -> int:
        return self.history.reserved

    @property
    def purge_seqno(self) -> int:
        return self.history.purge_seqno

    @purge_seqno.setter
    def purge_seqno(self, seqno: int) -> None:
        self.history.purge_seqno = seqno

    @property
    def refetch(self) -> bool:
        return self.history.refetch

    @property
    def continued(self) -> bool:
        return self.history.continued

    @property
    def meta_path(self) -> Path:
        return self.dir / META_NAME

    @property
    def needs_refetch(self) -> bool:
        """Set aside and not yet backfilled again from the TAP node."""
        return self.refetch and not self.translator.backfilled

    def open(
        self,
        *,
        expected: str | None = None,
        known_bound: int = 0,
        known_uuids: Iterable[int] = (),
    ) -> None:
        """Prove the log on disk and open it, or set it aside and start over.

        ``expected``: why this vbucket must have a log (then a missing
        directory is a loss, not a new vbucket); ``known_bound`` and
        ``known_uuids``: what the state directory's manifest remembers of it.
        """
        proof = prove_vbucket(
            self.dir, self.vbucket, expected=expected, replay=self.translator.replay
        )
        self.problems = proof.problems
        if proof.proven:
            adopt(self, proof)
        else:
            start_over(self, proof, known_bound, set(known_uuids))
        self._opened()

    def open_over(
        self, damaged: VbLog, problem: Problem, known_bound: int, known_uuids: Iterable[int]
    ) -> None:
        """Open as the successor of ``damaged`` (closed, found damaged while serving): its
        directory is set aside and this log starts over, as ``open`` does for a log it
        cannot prove."""
        self.problems = [problem]
        proof = VbProof(
            self.vbucket, self.dir, exists=self.dir.is_dir(), meta=damaged.meta(),
            problems=[problem], high_seen=damaged.high_seqno,
        )  # fmt: skip
        start_over(self, proof, known_bound, set(known_uuids))
        self._opened()

    def _opened(self) -> None:
        self.high_seqno = self._written_high = self.tail.floor = self.translator.high_seqno
        self._open_active()
        self._reserve(self.high_seqno, force=True)
        self.disk_bytes = sum(s.size for s in self.segments)

    def _open_active(self) -> None:
        """Open the segment to append to, starting a new one when the last is full.

        A failure leaves the previous state as it was (the next publish tries again).
        """
        if not self.segments or self.segments[-1].size >= self.segment_bytes:
            # Not the translator's high seqno: buffered items may be ahead of the file.
            first = self._written_high + 1
            active = Segment(self.dir / segment_name(first), first)
            active.path.touch()
            fsync_dir(self.dir)
            self.file.open(active.path, active.size, new=True)
            self.segments.append(active)
        else:
            active = self.segments[-1]
            self.file.open(active.path, active.size, new=False)
        self._mark = (len(active.sparse), active.count, active.last)
        self.buffer.realign(active.count)

    def meta(self, *, clean: bool = False) -> Meta:
        return Meta(
            failover=list(self.failover.entries),
            reserved=self.reserved,
            purge_seqno=self.purge_seqno,
            clean=clean,
            segments=[s.first for s in self.segments if s.path not in self.doomed],
            refetch=self.needs_refetch,
            high=self.disk_high if clean else 0,
        )

    def _write_meta(self, *, clean: bool) -> None:
        write_atomic(self.meta_path, self.meta(clean=clean).pack())

    def save_meta(self) -> None:
        self._write_meta(clean=False)

    def _reserve(self, upto: int, *, force: bool = False) -> None:
        """Move the reservation past ``upto`` in the meta and the manifest, or raise
        ``OSError`` with the reservation as it was (so the next call writes both)."""
        due = self.history.reservation_due(upto, force=force)
        if due is not None:
            old = self.history.reserved
            self.history.reserved = due
            try:
                self._write_meta(clean=False)
                if self.on_reserve is not None:
                    self.on_reserve(self)
            except OSError:
                self.history.reserved = old
                raise

    # -- appending -------------------------------------------------------------

    def ingest(self, message: TapStreamMessage, now: float) -> list[LogRecord]:
        """Translate and buffer one TAP message; nothing is visible before ``publish``."""
        records = self.translator.feed(message, now)
        for record in records:
            if type(record) is LogItem:
                self.append_item(record)
            else:
                self.append_mark(record)  # type: ignore[arg-type]
        return records

    def append_mark(self, mark: LogMark) -> None:
        """Buffer one mark the translator made (the ingest's fast path calls this)."""
        self.buffer.add_mark(mark)

    def append_item(self, item: LogItem) -> None:
        """Buffer one item the translator made (the event path)."""
        self.buffer.add_items([item])

    def append_items(self, items: list[LogItem]) -> None:
        """Buffer items the translator made, in order."""
        self.buffer.add_items(items)

    @property
    def items_total(self) -> int:
        """Items ever buffered since the log opened."""
        return self.buffer.total

    @property
    def unsynced(self) -> bool:
        """Written to the file since the last ``settle`` (an fsync is due)."""
        return self.file.unsynced

    @property
    def fsyncs(self) -> FsyncEpoch:
        """The active segment's fsyncs in flight and failed (``fsync_epoch``)."""
        return self.file.fsyncs

    @property
    def sync_in_doubt(self) -> bool:
        """An fsync of this file failed and not all it dropped is written again yet: an
        fsync returning 0 meanwhile proves nothing (Linux tells one fsync of the file)."""
        return self.fsyncs.unhandled or self.file.rewrite

    @property
    def syncing(self) -> int:
        """fsyncs of the active segment in flight (no roll until they return)."""
        return self.fsyncs.in_flight

    @property
    def sync_returned(self) -> trio.Event:
        """Set, and replaced, whenever an fsync of the active segment returns."""
        return self.fsyncs.returned

    @property
    def written_size(self) -> int:
        """Bytes of the active segment handed to the file (what an fsync now covers)."""
        return self.file.size

    @property
    def dirty(self) -> bool:
        return bool(self.buffer) or self.file.unsynced or self.file.rewrite

    def write(self) -> int:
        """Hand buffered records to the file (the OS); how many bytes.

        All or nothing: on a failure the file is cut back, the buffer kept,
        and ``LogWriteError`` raised. Call with ``lock`` held until ``publish``.
        """
        file = self.file
        if file.fsyncs.orphaned:
            file.adopt_orphans()
        if file.rewrite:
            file.write_again()
        buffer = self.buffer
        if not buffer.data:
            return 0
        if buffer.block >= 0:
            buffer.close_block()
        if file.broken is not None:
            raise LogWriteError(file.broken)
        if not file.written and not self.syncing:
            self._roll_if_full()  # a roll that failed at the last settle is retried first
            file = self.file
        segment = self.segments[-1]
        base = file.size
        data = buffer.data
        size = len(data)
        file.append(data)
        for seqno, offset in buffer.sparse:
            segment.sparse.append((seqno, base + offset))
        if buffer.items:
            segment.count += buffer.items
            segment.last = buffer.high
            self._written_high = self.disk_high = buffer.high
            self._unpublished.append((buffer.first, buffer.high, bytes(data)))
            framed = buffer.framed()
            if framed is not None and buffer.encoder is not None:
                self._framed.append((buffer.first, buffer.encoder, framed))
        self.disk_bytes += size
        buffer.clear()
        buffer.realign(segment.count)
        return size

    def sync(self) -> None:
        """fsync the active segment (may run in a worker thread); ``OSError`` if it fails.

        On a failure call ``unwrite`` (on the trio thread) before anything else.
        """
        self.file.sync()

    def unwrite(self, exc: OSError) -> LogWriteError:
        """After a failed fsync: cut the file back to what was published and put
        the records written since back in the buffer, to be written again; what
        was published stays so and is written again as it is (``SegmentFile.write_again``)."""
        buffer = self.buffer
        buffer.close_block()  # its offset is about to move
        segment = self.segments[-1]
        published = segment.size
        unpublished = self.file.take_back(published)
        if not unpublished:
            return LogWriteError(
                f"vbucket {self.vbucket}: fsync failed on {self.file.where}: "
                f"{exc.strerror or exc}; its {published - self.file.settled_size} bytes "
                "served already are written again with the same seqnos, nothing acknowledged"
            )
        n_sparse, count, last = self._mark
        moved = segment.sparse[n_sparse:]
        del segment.sparse[n_sparse:]
        shift = len(unpublished)
        buffer.sparse[:] = [(s, offset - published) for s, offset in moved] + [
            (s, offset + shift) for s, offset in buffer.sparse
        ]
        if not buffer.items:
            buffer.high = self._written_high
        buffer.items += segment.count - count
        segment.count, segment.last = count, last
        buffer.data[0:0] = unpublished
        buffer.spoil()
        if self._unpublished:
            buffer.first = self._unpublished[0][0]
        self._unpublished = []
        self._framed = []
        self.disk_bytes -= shift
        self.file.size = published
        self._written_high = self.high_seqno
        return self.file.cut_back(published, "fsync failed", exc)

    def publish(self, *, settle: bool = True) -> None:
        """Make what was written readable, and wake waiting streams.

        Only what ``write`` handed to the file: items still in the buffer
        (fed since) have seqnos but are not in the file yet. ``settle``: what
        was written is synced (or the policy is never to sync), see ``settle``;
        the batch policy publishes before its fsync and settles after it.
        """
        high = self._written_high
        if high > self.reserved:
            try:
                self._reserve(high)  # before any seqno above the old reservation is seen
            except OSError as exc:
                raise LogWriteError(
                    f"vbucket {self.vbucket}: cannot reserve seqnos in {self.dir.name}/"
                    f"{META_NAME}: {exc.strerror or exc}; nothing of the batch published"
                ) from exc
        segment = self.segments[-1]
        segment.size = self.file.size
        self._mark = (len(segment.sparse), segment.count, segment.last)
        if self._unpublished:
            self.tail.add(self._unpublished, self._framed)
            self._unpublished = []
            if self._framed:
                self._framed = []
                if self.tail.unused:  # its stream reads elsewhere now: stop framing for it
                    self.tail.unused = False
                    self.buffer.frame_for(None)
        if high != self.high_seqno:
            self.high_seqno = high
            self._wake()
        if settle:
            self.settle()

    def settle(self, upto: int | None = None) -> None:
        """The active segment is synced up to ``upto`` (default: all written), or
        never will be: forget those bytes, and start a new segment when the active
        one is full and no fsync of it is outstanding (so an fsync in flight is
        always of the file it was meant for)."""
        file = self.file
        if file.rewrite:
            return  # a failed fsync: written again and synced by a later commit
        file.settle(upto)
        if not file.unsynced and not self.syncing:
            self._roll_if_full()

    def write_early(self) -> int:
        """Write and publish now, before any fsync (fsync batch: the ingest calls it
        for each batch of frames). Skipped while a committer that publishes
        only synced records holds ``lock``, while the vbucket is handed over, or
        when the active segment is full (its roll waits for the commit's fsync); a
        failure is left for the commit, which writes the buffer again and raises.
        Bytes written."""
        if (
            not self.buffer
            or self.lock.locked()
            or self.handing_over
            or self.file.size >= self.segment_bytes
        ):
            return 0
        try:
            written = self.write()
            self.publish(settle=False)
        except LogWriteError:
            return 0
        return written

    def _roll_if_full(self) -> None:
        if self.segments[-1].size < self.segment_bytes:
            return
        try:
            self._open_active()
            self._write_meta(clean=False)  # lists the new segment before anything is in it
        except OSError as exc:
            raise LogWriteError(
                f"vbucket {self.vbucket}: cannot start a new segment in {self.dir.name}: "
                f"{exc.strerror or exc}; the next write tries again"
            ) from exc

    def read_memory(self, after: int, upto: int, sink: RecordSink) -> None:
        """``LogReads.read_memory``; a stream's framing read (``BatchCut``) also has the
        ingest frame this log's next writes for it (``log_preframing``)."""
        if type(sink) is BatchCut and sink.encoder is not self.buffer.encoder:
            self.buffer.frame_for(sink.encoder)
        self.tail.read(after, min(upto, self.high_seqno), sink)

    def drop_tail_upto(self, seqno: int) -> None:
        """Forget cached items up to ``seqno`` (compaction rewrote that part of the log:
        reads of it go to the compacted segments)."""
        self.tail.drop_upto(seqno)

    def close(self) -> None:
        """Clean close: everything written is synced and the meta says so.

        When the last write fails the log is left as a crash would leave it
        (no clean mark), and the next start proves it as such.
        """
        file = self.file
        if file.fd is None:
            return
        try:
            # A failed fsync left unhandled (a stop cancelled its commit) dropped pages a
            # later fsync says nothing about: what is not settled is written again first.
            file.rewrite = file.rewrite or bool(file.written)
            self.write()
            try:
                self.sync()
            except OSError as exc:
                raise self.unwrite(exc) from exc
            self.publish()
            file.close()
            self._write_meta(clean=True)
        except (OSError, LogWriteError) as exc:
            log.error("vbucket %d: closing the log failed: %s", self.vbucket, exc)
            self.abandon()

    def abandon(self) -> None:
        """Drop the file handle without the clean mark (a simulated crash in tests)."""
        self.file.close()

    def retire(self, why: str) -> None:
        """Drop the file handle for good (the log was set aside): a write raises
        ``LogWriteError``, never touches the directory that replaced this one."""
        self.abandon()
        self.file.broken = why

    # -- figures ---------------------------------------------------------------

    def bytes_on_disk(self) -> int:
        """Bytes of the segment files (a running total: no file system calls)."""
        return self.disk_bytes
