"""The segment file a vbucket log appends to: writes, fsyncs, and what a failure takes back.

``append`` hands bytes to the file (the OS) whole or not at all: when the
file system refuses part-way (a file-size limit, a full disk) the file is
cut back to where the append began and ``LogWriteError`` raised. The bytes
handed over since the last ``settle`` stay in ``written``: an fsync that
fails may have let the kernel drop those pages, so the log takes back what
it had not published (``take_back``, the file cut back to the published
size) and writes the published part again, the same bytes at the same
offsets (``write_again``): what consumers saw stays true, seqnos included.
``sync`` runs in a worker thread (``commit``); ``fsyncs`` says whether an
fsync that returned 0 proves anything (``fsync_epoch``). A file that could
not even be cut back is ``broken``: no more appends until a restart proves
the log again.
"""

from __future__ import annotations

import os
from pathlib import Path

from gateway.fronts.upr.config import UprFrontError
from gateway.fronts.upr.fsync_epoch import FsyncEpoch
from gateway.fronts.upr.segments import write_all


class LogWriteError(UprFrontError):
    """Appending to a vbucket's log failed; the log is as it was before the attempt."""


class SegmentFile:
    __slots__ = ("broken", "fd", "fsyncs", "path", "rewrite", "settled_size", "size",
                 "unsynced", "vbucket", "written")  # fmt: skip

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.path: Path | None = None
        self.fd: int | None = None
        self.broken: str | None = None
        """Set when a failed write could not even be cut back: no more appends."""
        self.size = 0
        """Bytes handed to the file (what an fsync now covers)."""
        self.written = bytearray()
        """Bytes handed to the file since the last ``settle`` (from ``settled_size`` on):
        written again if their fsync fails."""
        self.settled_size = 0
        """Where ``written`` starts (synced up to here)."""
        self.rewrite = False
        """A failed fsync left published bytes of ``written`` to be written again."""
        self.unsynced = False
        """Written since the last ``settle`` (an fsync is due)."""
        self.fsyncs = FsyncEpoch()
        """This file's fsyncs in flight and failed."""

    @property
    def where(self) -> str:
        path = self.path
        return "?" if path is None else f"{path.parent.name}/{path.name}"

    def open(self, path: Path, size: int, *, new: bool) -> None:
        """Append to ``path`` from now on (``size``: its published bytes). ``new``: another
        file than before (a roll, which waits for the old file's fsyncs)."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.path = fd, path
        self.size = self.settled_size = size
        if new:
            self.fsyncs = FsyncEpoch()

    def append(self, data: bytearray) -> None:
        """Hand ``data`` to the file, all or nothing (see the module)."""
        assert self.fd is not None
        base = self.size
        try:
            write_all(self.fd, data)
        except OSError as exc:
            raise self.cut_back(base, f"cannot append {len(data)} bytes", exc) from exc
        self.size += len(data)
        self.written += data
        self.unsynced = True

    def adopt_orphans(self) -> None:
        """A failed fsync nobody took back (its commit was cancelled): the pages it
        dropped are among those not settled, so all of them are written again."""
        if self.fsyncs.orphaned:
            self.rewrite = self.rewrite or bool(self.written)
            self.fsyncs.handled()

    def write_again(self) -> None:
        """After a failed fsync of published records: the same bytes at the same
        offsets (the kernel may have dropped those pages), so what consumers saw,
        seqnos included, is what becomes durable. ``LogWriteError`` if it fails."""
        if self.broken is not None:
            raise LogWriteError(self.broken)
        assert self.path is not None
        try:
            fd = os.open(self.path, os.O_WRONLY)  # not O_APPEND: pwrite must honour the offset
            try:
                view = memoryview(self.written)
                offset = self.settled_size
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            finally:
                os.close(fd)
        except OSError as exc:
            raise LogWriteError(
                f"vbucket {self.vbucket}: cannot write {len(self.written)} published bytes "
                f"again to {self.where}: {exc.strerror or exc}; "
                "nothing acknowledged, the next commit tries again"
            ) from exc
        self.rewrite = False
        self.unsynced = True

    def cut_back(self, size: int, what: str, exc: OSError) -> LogWriteError:
        """Truncate the file to ``size`` after a failed write or fsync."""
        try:
            assert self.fd is not None
            os.ftruncate(self.fd, size)
        except OSError as again:
            self.broken = (
                f"vbucket {self.vbucket}: {self.where} could not be cut back to {size} bytes "
                f"after a failed write ({again.strerror or again}); restart to prove it again"
            )
            return LogWriteError(self.broken)
        return LogWriteError(
            f"vbucket {self.vbucket}: {what} to {self.where}: {exc.strerror or exc}; "
            f"cut back to its last whole record ({size} bytes), nothing acknowledged"
        )

    def sync(self) -> None:
        """fsync the file (in a worker thread); ``OSError`` if it fails."""
        if self.fd is not None and self.unsynced:
            os.fsync(self.fd)

    def take_back(self, published: int) -> bytearray:
        """After a failed fsync: the bytes written beyond ``published`` (to be written
        again as new); the published ones are due to be written again as they are."""
        self.fsyncs.handled()
        keep = published - self.settled_size
        unpublished = self.written[keep:]
        del self.written[keep:]
        self.rewrite = keep > 0
        self.unsynced = False
        return unpublished

    def settle(self, upto: int | None) -> None:
        """Synced up to ``upto`` (default: all written), or never will be: forget those
        bytes. Nothing while published bytes are due to be written again."""
        if self.rewrite:
            return  # a failed fsync: written again and synced by a later commit
        if upto is None or upto > self.size:
            upto = self.size  # (cut back since by a failed fsync: settle what is left)
        drop = upto - self.settled_size
        if drop > 0:
            del self.written[:drop]
            self.settled_size = upto
        self.unsynced = self.size > self.settled_size

    def close(self) -> None:
        """Drop the file handle."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
