"""On-disk persistence for the store: one append-only msgpack journal.

Every change the store makes is appended as one record (an item version, a
state change, a failover log, a rollback, a reset, a purge). On start the
journal is replayed in order, which rebuilds exactly the state it described.

Framing makes it crash-safe without a separate index: each record is
``length u32, crc32 u32, msgpack bytes``. Replay stops at the first record
that is short or fails its checksum (a write torn by a crash) and cuts the
file there, so later appends never follow garbage.

``fsync`` policy: "always" writes and syncs every record before the change
is acknowledged; "batch" buffers and writes+syncs once the buffer is large
or ``batch_seconds`` have passed (checked with the caller's ``now``); "never"
buffers and leaves syncing to the OS. ``rewrite`` (compaction) writes the
given records to a temporary file, syncs it, renames it over the journal and
syncs the directory: a crash leaves either the old or the new file whole.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from gateway.node.items import Item, ItemKind

FILE_NAME = "store.journal"
FORMAT_VERSION = 1
FSYNC_POLICIES = ("always", "batch", "never")
_FRAME = struct.Struct(">II")
_READ_CHUNK = 1 << 20


class Rec(IntEnum):
    """First element of every record: what the rest of it means."""

    HEADER = 0  # version, n_vbuckets
    ITEM = 1  # vb, then the Item's fields (see item_record)
    STATE = 2  # vb, state
    FAILOVER = 3  # vb, [[uuid, seqno], ...] newest first
    ROLLBACK = 4  # vb, seqno
    RESET = 5  # vb
    PURGE = 6  # vb, older_than
    META = 7  # vb, state, high_seqno, max_deleted_rev, next_checkpoint_id, failover, snapshot
    SNAPSHOT = 8  # vb, start, end


def item_record(item: Item) -> list[Any]:
    return [
        Rec.ITEM,
        item.vbucket,
        item.key,
        item.value,
        item.by_seqno,
        item.rev_seqno,
        item.cas,
        item.flags,
        item.expiration,
        item.lock_time,
        item.datatype,
        int(item.kind),
        item.delete_time,
        item.checkpoint_id,
    ]


def record_item(record: list[Any]) -> Item:
    (_, vb, key, value, seqno, rev, cas, flags, exp, lock, dtype, kind, dtime, cp) = record
    return Item(key, value, vb, seqno, rev, cas, flags, exp, lock, dtype, ItemKind(kind), dtime, cp)


def _frame(record: list[Any], packb: Any) -> bytes:
    payload: bytes = packb(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class Journal:
    """The journal file of one store: replay, append, compaction."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: str = "batch",
        batch_seconds: float = 1.0,
        buffer_bytes: int = 1 << 20,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, not {fsync!r}")
        self.dir = Path(data_dir)
        self.path = self.dir / FILE_NAME
        self.fsync = fsync
        self.batch_seconds = batch_seconds
        self.buffer_bytes = buffer_bytes
        self.records = 0
        """Records in the file (a measure of how much compaction would save)."""
        self._packb = msgpack.Packer(use_bin_type=True).pack
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._last_flush: float | None = None
        self._file: BinaryIO | None = None
        self._good: int | None = None  # length of the intact prefix found by replay

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def replay(self) -> Iterator[list[Any]]:
        """Every whole, intact record in the journal, oldest first.

        Stops at a torn or corrupt tail; ``open`` then cuts it off.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        # A leftover temporary file is an unfinished compaction: the journal is still whole.
        with contextlib.suppress(FileNotFoundError):
            (self.dir / (FILE_NAME + ".tmp")).unlink()
        self._good = 0
        self.records = 0
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for end, record in _read_records(f):
                self._good = end
                self.records += 1
                yield record

    def open(self) -> None:
        """Open for appending, after ``replay`` (or on a new journal)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
        if self._good is not None and self._file.tell() != self._good:
            self._file.truncate(self._good)
            self._sync()

    def append(self, record: list[Any], now: float | None = None) -> None:
        if self._file is None:
            raise RuntimeError("the store's journal is not open")
        data = _frame(record, self._packb)
        self.records += 1
        if self.fsync == "always":
            self._write(data)
            self._sync()
            return
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered >= self.buffer_bytes:
            self.flush()
        elif now is not None:
            self.maybe_flush(now)

    def maybe_flush(self, now: float) -> None:
        """Flush a batch once ``batch_seconds`` have passed since the last one."""
        if self._last_flush is None:
            self._last_flush = now
        elif now - self._last_flush >= self.batch_seconds:
            self.flush()
            self._last_flush = now

    def flush(self) -> None:
        """Write the buffer out; sync it unless the policy is "never"."""
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            self._buffered = 0
            self._write(data)
        if self.fsync == "never":
            if self._file is not None:
                self._file.flush()  # to the OS, which writes it when it likes
        else:
            self._sync()

    def rewrite(self, records: Iterable[list[Any]]) -> None:
        """Replace the journal with ``records``, atomically (compaction)."""
        self.flush()
        tmp = self.dir / (FILE_NAME + ".tmp")
        count = 0
        with open(tmp, "wb") as f:
            chunk: list[bytes] = []
            size = 0
            for record in records:
                data = _frame(record, self._packb)
                chunk.append(data)
                size += len(data)
                count += 1
                if size >= self.buffer_bytes:
                    f.write(b"".join(chunk))
                    chunk.clear()
                    size = 0
            f.write(b"".join(chunk))
            f.flush()
            os.fsync(f.fileno())
        if self._file is not None:
            self._file.close()
        os.replace(tmp, self.path)
        _sync_dir(self.dir)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
        self.records = count

    def close(self) -> None:
        if self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None

    def _write(self, data: bytes) -> None:
        if self._file is None:
            raise RuntimeError("the store's journal is closed")
        self._file.write(data)

    def _sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())


def _read_records(f: BinaryIO) -> Iterator[tuple[int, list[Any]]]:
    """(offset just past the record, record) for every whole, intact record."""
    buf = b""
    pos = 0  # offset of buf[0] in the file
    view = 0  # read position in buf
    while True:
        if len(buf) - view < _FRAME.size:
            buf, pos, view = _refill(f, buf, pos, view)
            if len(buf) - view < _FRAME.size:
                return
        length, crc = _FRAME.unpack_from(buf, view)
        end = view + _FRAME.size + length
        if end > len(buf):
            buf, pos, view = _refill(f, buf, pos, view, need=_FRAME.size + length)
            end = view + _FRAME.size + length
            if end > len(buf):
                return  # torn tail
        payload = buf[view + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            return
        try:
            record = msgpack.unpackb(payload)
        except (ValueError, TypeError):
            return
        if not isinstance(record, list) or not record:
            return
        view = end
        yield pos + end, record


def _refill(f: BinaryIO, buf: bytes, pos: int, view: int, need: int = 0) -> tuple[bytes, int, int]:
    """Drop what was consumed from ``buf`` and read at least a chunk (or ``need``) more."""
    rest = buf[view:]
    more = f.read(max(_READ_CHUNK, need - len(rest)))
    return rest + more, pos + view, 0


def _sync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
