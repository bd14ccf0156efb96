"""Segment files of the UPR front's log: length + crc framed records.

A record on disk is ``length u32, crc32 u32, payload``. The payload is a
msgpack list (``adapters.translate.log_records.to_row``: a mark, an item,
or a segment header row), or a block of items: the byte ``BLOCK_TAG``
(0xc1, which msgpack never uses) then, per item, its fixed fields packed
with ``ITEM`` followed by its key and value. The ingest buffers the items
of one vbucket between two marks as one block (``buffer_items``): one
struct pack per item and one crc per block, where a row cost a msgpack
pack and a crc per item. An item a field of which does not fit ``ITEM``
goes as a row of its own; logs written with a row per item (before
blocks) read as they always did.

``scan`` reads a file front to back as rows (a block as the row of each of
its items, all at the block's offset, the last one ending where the block
ends) and stops quietly at the first record that is short or fails its crc
(readers only read published bytes, which are whole). ``walk_records``
feeds the items of a chunk's whole records to a sink: ``read_items`` makes
them ``LogItem``s without rows, and the serving read
(``log_to_upr_fast.BatchCut``) frames UPR messages from a block's bytes
directly.

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

import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack

from adapters.translate.log_records import BLOCK_ITEM, ItemKind, LogItem, LogMark, from_row, to_row
from gateway.fronts.upr.config import UprFrontError

FRAME = struct.Struct(">II")
MAX_RECORD = 64 * 1024 * 1024
HEADER_ROW = 2
"""Row tag of a compacted segment's header: [2, covers_upto_seqno]."""
READ_CHUNK = 256 * 1024
"""Bytes a disk read of the log asks the file for at once."""
SPARSE_EVERY = 64
"""One (seqno, offset) pair of a segment's sparse index per this many items
(the offset of the record holding it: a block's, for an item in a block)."""
BLOCK_TAG = 0xC1
"""First payload byte of a block of items (a byte msgpack never uses)."""
ROW_STARTS = frozenset({0x92, 0x93, 0x9F, BLOCK_TAG})
"""First payload byte of every record the log writes: a msgpack array of 2 (segment
header), 3 (mark) or 15 (item) elements, or a block."""
ITEM = BLOCK_ITEM
"""An item in a block (``log_records.BLOCK_ITEM``), then its key and value."""
BLOCK_BYTES = 64 * 1024
"""A block is closed once it holds this many bytes (and at every mark and write)."""

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
    return frame_mark_fields(int(mark.kind), mark.value)


def frame_mark_fields(kind: int, value: int) -> bytes:
    """``frame_mark(LogMark(kind, value))`` without the mark."""
    payload: bytes = _pack([1, kind, value])
    return _frame_head(len(payload), _crc32(payload)) + payload


_item_pack = ITEM.pack
_item_unpack = ITEM.unpack_from
_ITEM_SIZE = ITEM.size
BLOCK_OPEN = bytes(FRAME.size) + bytes((BLOCK_TAG,))
"""An open block: its frame header, filled in when it closes, and the tag."""
_KINDS = tuple(ItemKind)
_tuple_new = tuple.__new__
_MARK_ROW = 0x93
"""First payload byte of a mark's row (``to_row``: a msgpack array of 3)."""


def buffer_items(
    buffer: bytearray,
    block: int,
    items: list[LogItem],
    first: int,
    sparse: list[tuple[int, int]],
    block_bytes: int = BLOCK_BYTES,
    every: int = SPARSE_EVERY,
) -> int:
    """Append ``items`` to ``buffer``: to the block open at offset ``block`` (-1: none
    open), opening a new one when there is none or it is full; an item a field of
    which the block cannot hold goes as a row of its own.

    ``sparse`` gets (seqno, offset of the record holding it) of the items at
    ``first``, ``first + every``, ... Returns the block open now (-1:
    none). Nothing may go into ``buffer`` but items while a block is open:
    ``close_block`` it first. A block is closed once it holds more than
    ``block_bytes``.
    """
    pack = _item_pack
    for n, item in enumerate(items):
        (seqno, kind, key, value, rev, cas, flags, exp, lock, dtype, cp, bf, cs, arr, dt) = item
        try:
            packed = pack(seqno, kind, bf | cs << 1, dtype, len(key), len(value), rev, cas,
                          flags, exp, lock, cp, arr, dt)  # fmt: skip
        except struct.error:  # a field out of the block's range: a row takes anything
            close_block(buffer, block)
            block = -1
            at = len(buffer)
            buffer += frame_item(item)
        else:
            if block < 0 or len(buffer) - block > block_bytes:
                close_block(buffer, block)
                block = len(buffer)
                buffer += BLOCK_OPEN
            at = block
            buffer += packed
            buffer += key
            buffer += value
        if n == first:
            sparse.append((seqno, at))
            first += every
    return block


def close_block(buffer: bytearray, block: int) -> None:
    """Fill in the frame header of the block open at ``block`` (-1: none open)."""
    if block >= 0:
        with memoryview(buffer) as view, view[block + FRAME.size :] as payload:
            crc = _crc32(payload)
        FRAME.pack_into(buffer, block, len(buffer) - block - FRAME.size, crc)


def _block_items(payload: bytes) -> list[LogItem] | None:
    """The items of a block's payload (tag first); None if it does not parse."""
    out: list[LogItem] = []
    at, size = 1, len(payload)
    try:
        while at < size:
            (seqno, kind, bits, dtype, klen, vlen, rev, cas, flags, exp, lock, cp, arr,
             dt) = _item_unpack(payload, at)  # fmt: skip
            key = at + _ITEM_SIZE
            value = key + klen
            at = value + vlen
            out.append(LogItem(seqno, _KINDS[kind], payload[key:value], payload[value:at], rev,
                               cas, flags, exp, lock, dtype, cp, bits & 1 == 1, bits & 2 == 2,
                               arr, dt))  # fmt: skip
    except (struct.error, IndexError):
        return None
    return out if at == size else None


def _read_block(
    payload: bytes, out: list[LogItem], after: int, upto: int, limit: int, left: int
) -> tuple[int, int]:
    """``read_items`` over one block's payload: (-1 if it does not parse, 1 if the read
    is done, else 0; the bytes left)."""
    append = out.append
    at, size = 1, len(payload)
    kinds, unpack, item_size, new = _KINDS, _item_unpack, _ITEM_SIZE, _tuple_new
    try:
        while at < size:
            (seqno, kind, bits, dtype, klen, vlen, rev, cas, flags, exp, lock, cp, arr,
             dt) = unpack(payload, at)  # fmt: skip
            key = at + item_size
            value = key + klen
            at = value + vlen
            if seqno <= after:
                continue
            if seqno > upto:
                return 1, left
            append(new(LogItem, (seqno, kinds[kind], payload[key:value], payload[value:at], rev,
                                 cas, flags, exp, lock, dtype, cp, bits & 1 == 1, bits & 2 == 2,
                                 arr, dt)))  # fmt: skip
            after = seqno
            if len(out) >= limit >= 0:
                return 1, left
            if left >= 0:
                left -= klen + vlen
                if left <= 0:
                    return 1, left
    except (struct.error, IndexError):
        return -1, left
    return (0 if at == size else -1), left


class RecordSink(Protocol):
    """What a read of the log feeds the items of the records it walks (``walk_records``)."""

    def block(self, payload: bytes) -> int:
        """A block's payload (tag first): -1 if it does not parse, 1 if the read is
        done, else 0."""
        ...

    def item(self, item: LogItem) -> bool:
        """The item of a row; True if the read is done."""
        ...


class LogItemSink:
    """The items read, as ``LogItem``s (``read_items``)."""

    __slots__ = ("after", "left", "limit", "out", "upto")

    def __init__(self, out: list[LogItem], after: int, upto: int, limit: int, left: int) -> None:
        self.out = out
        self.after = after
        self.upto = upto
        self.limit = limit
        self.left = left

    def block(self, payload: bytes) -> int:
        out = self.out
        state, self.left = _read_block(payload, out, self.after, self.upto, self.limit, self.left)
        if out:
            self.after = out[-1].by_seqno
        return state

    def item(self, item: LogItem) -> bool:
        seqno = item.by_seqno
        if seqno <= self.after:
            return False
        if seqno > self.upto:
            return True
        self.out.append(item)
        self.after = seqno
        if len(self.out) >= self.limit:
            return True
        if self.left >= 0:
            self.left -= len(item.key) + len(item.value)
            if self.left <= 0:
                return True
        return False


def walk_records(
    data: bytes | memoryview, base: int, sink: RecordSink, *, verify: bool = True
) -> tuple[int, bool]:
    """Feed ``sink`` the items of the whole records of ``data`` (``base``: its offset in
    the file), in order, until it says the read is done.

    Returns (the file offset after the last whole record read, whether the
    read is done). Stops quietly where ``scan_bytes`` stops. ``verify``: check
    each record's crc (not for bytes that never left memory: the log's tail).
    """
    offset, size = 0, len(data)
    unpack_frame, unpackb, crc32 = FRAME.unpack_from, msgpack.unpackb, _crc32
    view = memoryview(data)  # payloads as bytes (sinks hash keys), each copied once
    while offset + 8 <= size:
        length, crc = unpack_frame(data, offset)
        body = offset + 8
        end = body + length
        if length > MAX_RECORD or end > size or not length:
            break
        first = data[body]
        if first == _MARK_ROW and not verify:
            offset = end  # a mark (a msgpack array of 3): no item in it, not even copied
            continue
        payload = bytes(view[body:end])
        if verify and crc32(payload) != crc:
            break
        if first == _MARK_ROW:
            pass  # a mark: no item in it, nothing to unpack
        elif first == BLOCK_TAG:
            state = sink.block(payload)
            if state < 0:
                break
            if state:
                return base + end, True
        else:
            try:
                row = unpackb(payload, raw=False, use_list=True)
            except Exception:  # a crc collision on garbage
                break
            if not isinstance(row, list) or not row:
                break
            record = from_row(row) if row[0] == 0 else None
            # A row of an item: the logs written before blocks, or a field a block cannot hold.
            if type(record) is LogItem and sink.item(record):
                return base + end, True
        offset = end
    return base + offset, False


def read_items(
    data: bytes, base: int, out: list[LogItem], after: int, upto: int, limit: int, left: int
) -> tuple[int, int, bool]:
    """Append to ``out`` the items of the whole records of ``data`` (``base``: its offset
    in the file) with ``after < by_seqno <= upto``, until ``out`` holds ``limit`` or
    their keys and values reach ``left`` bytes (-1: no byte limit).

    Returns (the file offset after the last whole record read, the bytes left,
    whether the read is done: an item beyond ``upto``, or a limit reached).
    Stops quietly where ``scan_bytes`` stops.
    """
    sink = LogItemSink(out, after, upto, limit, left)
    end, done = walk_records(data, base, sink)
    return end, sink.left, done


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
        if length and payload[0] == BLOCK_TAG:
            items = _block_items(payload)
            if not items:
                return
            last = len(items) - 1
            for n, item in enumerate(items):
                # Every item at the block's offset: a reader starts at the block.
                yield base + offset, base + (body + length if n == last else offset), to_row(item)
            offset = body + length
            continue
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
        self.segments: list[Segment] = []
        """The segment of each part."""

    def close(self) -> None:
        for fd, _offset, _size in self.parts:
            os.close(fd)
        self.parts = []
        self.segments = []

    def __enter__(self) -> DiskPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LogReadError(UprFrontError):
    """Published bytes of a segment no longer read back as whole records."""


def unreadable(where: str, offset: int, size: int) -> str:
    # Not skipped as gaps: the consumer would hold a history with holes and never
    # be told to roll back.
    return (
        f"{where}: no whole record at offset {offset} of its {size} published bytes "
        "(damaged on disk); not served past it"
    )


def read_planned(
    plan: DiskPlan, after: int, upto: int, limit: int, max_bytes: int | None
) -> list[LogItem]:
    """The items of ``plan``'s files with ``after < seqno <= upto`` (see ``vblog.VbLog.read``)."""
    out: list[LogItem] = []
    sink = LogItemSink(out, after, upto, limit, max_bytes if max_bytes is not None else -1)
    for (fd, offset, size), segment in zip(plan.parts, plan.segments, strict=True):
        where = f"{segment.path.parent.name}/{segment.path.name}"
        if feed_part(fd, offset, size, sink, READ_CHUNK, pread, where):
            break
    return out


_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_cache_buffers = threading.local()
"""Each thread's buffer for ``pread_cached`` (an anonymous map, kept)."""


def pread_cached(fd: int, offset: int, size: int) -> memoryview | None:
    """``pread``, if the page cache holds all those bytes now; else None, at once
    (``RWF_NOWAIT``: never waits for the disk, so it may run on the loop).

    The bytes are a view of this thread's one buffer, valid until its next call:
    walk them before anything else may read (``walk_records`` copies what it
    keeps). The buffer is an anonymous map allocated once and kept (grown for a
    bigger read): a map per read cost about 0.5 ms of page faults per 256 KiB
    here, 16 times the read, and chunks on the heap would fragment it between
    the long-lived buffers of stalled connections."""
    if _NOWAIT is None:
        return None
    buffer: mmap.mmap | None = getattr(_cache_buffers, "map", None)
    if buffer is None or len(buffer) < size:
        buffer = _cache_buffers.map = mmap.mmap(-1, max(size, READ_CHUNK))
    view = memoryview(buffer)[:size]
    try:
        got = os.preadv(fd, [view], offset, _NOWAIT)
    except OSError:  # EAGAIN: not all cached; EOPNOTSUPP: a file system without it
        view.release()
        return None
    if got != size:
        view.release()
        return None
    return view


def pread(fd: int, offset: int, size: int) -> bytes:
    """``size`` bytes of the file at ``offset`` (the one call a disk read makes in a
    worker thread)."""
    return os.pread(fd, size, offset)


def feed_part(
    fd: int,
    offset: int,
    size: int,
    sink: RecordSink,
    chunk: int,
    read: Callable[[int, int, int], bytes],
    where: str = "",
) -> bool:
    """Feed ``sink`` one part of a plan on the calling thread; whether the read is done."""
    want = chunk
    while offset < size:
        data = read(fd, offset, min(want, size - offset))
        end, done = walk_records(data, offset, sink)
        if done:
            return True
        if end == offset:
            if want >= size - offset:
                raise LogReadError(unreadable(where or f"fd {fd}", offset, size))
            want *= 2  # a record bigger than the chunk
            continue
        want = chunk
        offset = end
    return False
