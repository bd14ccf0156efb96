"""Compaction of a vbucket's log: the latest version of each key, tombstones for a while.

Theory of operation. Only sealed segments (every one but the active) are
compacted, in a worker thread: their records are read in order and an item
is kept when the index still names it as its key's latest version (or that
latest version is in the active segment while it has unsynced records), unless
it is a tombstone older than the purge interval (dropped; the vbucket's
purge seqno rises to it, so a consumer starting below it rolls back to 0
instead of missing the delete). The last mark of each kind is kept, so a
restart still knows the last closed checkpoint and the backfill state.

The result is written as one segment with a header row naming the last
seqno it covers, fsynced, and renamed over the first sealed segment; the
others are then deleted, once the meta no longer lists them (so their
absence is never taken for a loss). A crash between the rename and the
deletes leaves covered segments behind, which opening the log deletes; a
crash before the rename leaves them uncovered and still read. Readers re-resolve
segments by seqno on every read, and an open file survives its unlinking.
A new segment the disk refuses (full, a file-size limit) changes nothing: its
file is removed, ``CompactionError`` says which and why, and the sealed
segments stay until the next round.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import trio

from adapters.translate.log_records import LogItem, LogMark, from_row
from gateway.fronts.upr.segments import HEADER_ROW, SPARSE_EVERY, Segment, frame, scan
from gateway.fronts.upr.vblog import VbLog
from gateway.runtime.files import fsync_dir


class CompactionError(Exception):
    """A compaction could not write its new segment; the log is as it was."""


def _compact_files(
    vblog: VbLog, sealed: list[Segment], older_than: float, unproven: int
) -> tuple[Segment, int, list[tuple[bytes, int]]]:
    index = vblog.translator.index
    covers = max(s.last for s in sealed) or sealed[-1].first
    marks: dict[int, tuple[int, list[Any]]] = {}
    kept: list[bytes] = [frame([HEADER_ROW, covers])]
    purged: list[tuple[bytes, int]] = []
    positions: list[int] = []
    seqnos: list[int] = []
    position = 0
    size = len(kept[0])
    for segment in sealed:
        for _offset, _end, row in scan(segment.path, 0, segment.size):
            if row[0] == HEADER_ROW:
                continue
            record = from_row(row)
            if isinstance(record, LogMark):
                marks[record.kind.value] = (position, row)
                position += 1
                continue
            assert isinstance(record, LogItem)
            position += 1
            latest = index.get(record.key)
            if latest is None:
                continue
            if latest[0] != record.by_seqno:  # the index's seqno (``TapToUpr.version``)
                if latest[0] < unproven:
                    continue
                # Its successor may be served but not synced yet (fsync batch): a power
                # loss would take it, so this version stays until that one is sealed.
            elif record.deleted and record.arrival < older_than:
                purged.append((record.key, record.by_seqno))
                continue
            data = frame(row)
            positions.append(size)
            seqnos.append(record.by_seqno)
            kept.append(data)
            size += len(data)
    for _, row in sorted(marks.values(), key=lambda pair: pair[0]):
        kept.append(frame(row))
        size += len(kept[-1])
    target = sealed[0].path
    tmp = target.with_name(target.name + ".compact")
    try:
        with open(tmp, "wb") as f:
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    result = Segment(target, sealed[0].first, size=size)
    for seqno, offset in zip(seqnos, positions, strict=True):
        if result.count % SPARSE_EVERY == 0:
            result.sparse.append((seqno, offset))
        result.count += 1
        result.last = seqno
    return result, max((s for _, s in purged), default=0), purged


def _install(tmp: Path, target: Path, doomed: list[Path]) -> None:
    os.replace(tmp, target)
    fsync_dir(target.parent)
    for path in doomed:
        path.unlink(missing_ok=True)
    fsync_dir(target.parent)


async def compact_log(vblog: VbLog, now: float, purge_interval: float) -> int:
    """Compact ``vblog``'s sealed segments; bytes saved on disk."""
    sealed = list(vblog.segments[:-1])
    if not sealed or (len(sealed) == 1 and sealed[0].path == vblog.compacted_path):
        return 0
    before = sum(s.path.stat().st_size for s in sealed)
    # Sealed segments are synced; the active one's records may not all be yet (fsync
    # batch publishes first): then no version of it is trusted to replace an older one.
    synced = not vblog.unsynced and not vblog.sync_in_doubt
    unproven = vblog.high_seqno + 1 if synced else vblog.segments[-1].first
    try:
        result, purge_seqno, purged = await trio.to_thread.run_sync(
            _compact_files, vblog, sealed, now - purge_interval, unproven
        )
    except OSError as exc:
        name = f"{vblog.dir.name}/{sealed[0].path.name}.compact"
        raise CompactionError(
            f"vbucket {vblog.vbucket}: compaction skipped: cannot write {name}: "
            f"{exc.strerror or exc}; the sealed segments stay as they are"
        ) from exc
    # Before the tombstones vanish: consumers below the purge seqno must start over.
    vblog.purge_seqno = max(vblog.purge_seqno, purge_seqno)
    # Before any segment is deleted: the meta must no longer list it, or the
    # next start would take the deletion for a loss.
    doomed = {s.path for s in sealed[1:]}
    vblog.doomed |= doomed
    tmp = result.path.with_name(result.path.name + ".compact")
    # From the replace until ``segments`` names the new file, a read would use the
    # old offsets on it: readers wait (``VbLog.segments_settled``).
    vblog.begin_segment_swap()
    try:
        try:
            vblog.save_meta()
            await trio.to_thread.run_sync(_install, tmp, result.path, [s.path for s in sealed[1:]])
        finally:
            vblog.doomed -= doomed
        assert all(a is b for a, b in zip(vblog.segments, sealed, strict=False))
        vblog.segments[: len(sealed)] = [result]
    finally:
        vblog.end_segment_swap()
    vblog.compacted_path = result.path
    vblog.disk_bytes -= before - result.size
    vblog.drop_tail_upto(max(s.last for s in sealed))
    for key, seqno in purged:
        vblog.translator.forget(key, seqno)
    return before - result.size
