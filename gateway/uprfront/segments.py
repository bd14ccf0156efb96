"""Segment files of the UPR front's log: length + crc framed msgpack records.

A record on disk is ``length u32, crc32 u32, payload``, the payload a
msgpack list (``adapters.translate.log_records.to_row``, or a segment header
row). ``scan`` reads a file front to back and stops quietly at the first
record that is short or fails its crc (readers only read published bytes,
which are whole).

``tail_fault`` judges where such a scan stopped when a log is opened. Only
an unfinished write may be cut off as a torn tail: a record cut short by
the end of the file, or a zero-filled end (a file the crash extended before
its data reached the disk), with no whole record anywhere after it. A crash
can leave nothing else, since everything before the last fsync is whole on
disk. A record of full length that fails its crc, a length over the limit,
or a cut-short record followed by whole ones (a flipped length field) is
damage, and so is a cut-short record whose bytes to the end pass its crc
(a damaged length field on a whole last record): the caller sets the log
aside instead of cutting what may be acknowledged data.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from adapters.translate.log_records import LogItem, LogMark, from_row

FRAME = struct.Struct(">II")
MAX_RECORD = 64 * 1024 * 1024
HEADER_ROW = 2
"""Row tag of a compacted segment's header: [2, covers_upto_seqno]."""
READ_CHUNK = 256 * 1024
"""Bytes a disk read of the log asks the file for at once."""
SPARSE_EVERY = 64
"""One (seqno, offset) pair of a segment's sparse index per this many items."""
ROW_STARTS = frozenset({0x92, 0x93, 0x9F})
"""First payload byte of every row the log writes: a msgpack array of 2 (segment
header), 3 (mark) or 15 (item) elements."""

_packer = msgpack.Packer(use_bin_type=True)


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


def segment_name(first: int) -> str:
    return f"{first:020d}.seg"


def frame(row: list[Any]) -> bytes:
    payload: bytes = _packer.pack(row)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


_pack = _packer.pack
_frame_head = FRAME.pack
_crc32 = zlib.crc32


def frame_item(item: LogItem) -> bytes:
    """``frame(to_row(item))`` in one call (once per logged item)."""
    (seqno, kind, key, value, rev, cas, flags, exp, lock, dtype, cp, bf, cs, arr, dt) = item
    payload: bytes = _pack([0, seqno, int(kind), key, value, rev, cas, flags, exp, lock, dtype,
                            cp, bf | cs << 1, arr, dt])  # fmt: skip
    return _frame_head(len(payload), _crc32(payload)) + payload


def frame_mark(mark: LogMark) -> bytes:
    """``frame(to_row(mark))`` without the enum's ``.value`` descriptor (a live 2.x
    stream logs two checkpoint marks per item)."""
    payload: bytes = _pack([1, int(mark.kind), mark.value])
    return _frame_head(len(payload), _crc32(payload)) + payload


def scan(
    path: Path, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, int, list[Any]]]:
    """(offset, end offset, row) of each whole record from ``start`` to ``stop``.

    Stops quietly at a torn record; ``tail_fault`` tells what the rest is.
    """
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if stop is None else f.read(max(0, stop - start))
    yield from scan_bytes(data, start)


def scan_bytes(data: bytes, base: int = 0) -> Iterator[tuple[int, int, list[Any]]]:
    offset, size = 0, len(data)
    unpackb = msgpack.unpackb
    while offset + FRAME.size <= size:
        length, crc = FRAME.unpack_from(data, offset)
        body = offset + FRAME.size
        if length > MAX_RECORD or body + length > size:
            return
        payload = data[body : body + length]
        if zlib.crc32(payload) != crc:
            return
        try:
            row = unpackb(payload, raw=False, use_list=True)
        except Exception:  # a crc collision on garbage: tail_fault calls it damage
            return
        if not isinstance(row, list) or not row:
            return
        yield base + offset, base + body + length, row
        offset = body + length


def tail_fault(data: bytes, at: int) -> str | None:
    """What is wrong at ``at``, where a scan of ``data`` stopped; None for a torn tail.

    A torn tail is what an interrupted append leaves: a record cut short by
    the end of the file, or zeros to the end, and no whole record after it.
    """
    rest = len(data) - at
    if rest <= 0 or data.count(0, at) == rest or rest < FRAME.size:
        return None
    length, crc = FRAME.unpack_from(data, at)
    body = at + FRAME.size
    if length > MAX_RECORD:
        return f"record length {length} over the {MAX_RECORD}-byte limit"
    if body + length <= len(data):
        if zlib.crc32(data[body : body + length]) != crc:
            return "record fails its crc"
        return "record is not a log row"
    # Cut short, as an interrupted append leaves it, or a damaged length field?
    whole = next_whole_record(data, at + 1)
    if whole is not None:
        return f"record length {length} runs past the end, yet a whole record follows at {whole}"
    if zlib.crc32(data[body:]) == crc:
        return f"record length {length} runs past the end, yet the bytes to the end pass its crc"
    return None


def next_whole_record(data: bytes, start: int) -> int | None:
    """Offset of the first whole, crc-valid record at or after ``start`` (a resync)."""
    size = len(data)
    unpack_from, crc32 = FRAME.unpack_from, zlib.crc32
    for offset in range(start, size - FRAME.size):
        body = offset + FRAME.size
        if data[body] not in ROW_STARTS:
            continue
        length, crc = unpack_from(data, offset)
        if length == 0 or body + length > size or crc32(data[body : body + length]) != crc:
            continue
        return offset
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a crash leaves the old or the new file, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (an append descriptor), or raise ``OSError``.

    A short write (a file-size limit, a full disk) is retried for the rest,
    which then fails with the real error; the caller cuts the file back.
    """
    # Views released on the way out, even by an exception: the buffer is resized after.
    with memoryview(data) as whole:
        done, size = 0, len(whole)
        while done < size:
            with whole[done:] as rest:
                done += os.write(fd, rest)


class DiskPlan:
    """Open segment files and where to read them: (fd, start offset, published size)."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, int, int]] = []

    def close(self) -> None:
        for fd, _offset, _size in self.parts:
            os.close(fd)
        self.parts = []

    def __enter__(self) -> DiskPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_planned(
    plan: DiskPlan, after: int, upto: int, limit: int, max_bytes: int | None
) -> list[LogItem]:
    """The items of ``plan``'s files with ``after < seqno <= upto`` (see ``vblog.VbLog.read``);
    touches nothing but those files, so it may run in a worker thread."""
    out: list[LogItem] = []
    left = max_bytes if max_bytes is not None else -1
    for fd, offset, size in plan.parts:
        want = READ_CHUNK
        while offset < size:
            chunk = os.pread(fd, min(want, size - offset), offset)
            end = offset
            for _start, record_end, row in scan_bytes(chunk, offset):
                end = record_end
                if row[0] != 0:
                    continue
                seqno = row[1]
                if seqno <= after:
                    continue
                if seqno > upto:
                    return out
                item = from_row(row)
                assert type(item) is LogItem
                out.append(item)
                after = seqno
                if len(out) >= limit:
                    return out
                if left >= 0:
                    left -= len(item.key) + len(item.value)
                    if left <= 0:
                        return out
            if end == offset:
                if want >= size - offset:
                    break  # nothing whole left (cannot happen once published)
                want *= 2  # a record bigger than the chunk
                continue
            want = READ_CHUNK
            offset = end
    return out
