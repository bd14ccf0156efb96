"""Capture segment files: a small header, then CRC-checked blocks of msgpack records.

Layout of one segment::

    magic "TUCAPSEG" | schema version u16 | metadata length u32 | metadata (msgpack map)
    block*: payload length u32 | record count u32 | CRC-32 of payload u32 | payload

A payload is records packed back to back, so a block cut short by a crash
still yields every record that was written whole before the cut. The
metadata names the side (``tap``/``upr``), connection, direction
(``received``/``sent``), the recorder's run id and the segment's number.

Writers append whole blocks and rotate to a new segment past a size limit.
Readers accept a torn last block (a crash or a copy of a file still being
written): they keep the whole records before the tear and say so in
``CaptureSegment.torn``. Damage anywhere else is a ``SegmentError`` naming the
file and offset.
"""

from __future__ import annotations

import os
import re
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

try:
    import msgpack
except ImportError:  # a Spark executor without msgpack: the pure-Python copy verify shipped
    import importlib

    msgpack = importlib.import_module("_tapupr_shipped.msgpack")

from adapters.errors import GatewayError
from gateway.tools.capture.records import FIELD_COUNT, SCHEMA_VERSION, CaptureRecord

MAGIC = b"TUCAPSEG"
SUFFIX = ".tucap"
_HEAD = struct.Struct(">8sHI")
_BLOCK = struct.Struct(">III")
MAX_METADATA_BYTES = 64 * 1024
MAX_BLOCK_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_BLOCK_RECORDS = 2048
SIDES = ("tap", "upr")
DIRECTIONS = ("received", "sent")


class SegmentError(GatewayError):
    """A segment file is not a capture, or is damaged before its last block."""

    def __init__(self, source: str, reason: str, offset: int | None = None) -> None:
        self.source = source
        self.reason = reason
        self.offset = offset
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(f"{source}: {reason}{where}")


@dataclass(frozen=True, slots=True)
class TornTail:
    """The last block was cut short (or its checksum fails): what was kept."""

    offset: int
    """Where the torn block starts."""
    lost_bytes: int
    """Bytes of the torn block (its header included) that became no record."""
    salvaged: int
    """Whole records kept from the torn block."""
    reason: str

    def describe(self) -> str:
        return (
            f"torn last block at offset {self.offset}: {self.reason}; "
            f"kept {self.salvaged} whole records, dropped {self.lost_bytes} bytes"
        )


@dataclass(slots=True)
class CaptureSegment:
    meta: dict[str, Any]
    records: list[list[Any]] = field(default_factory=list)
    """Raw records in field order (see ``CaptureRecord``); ``typed()`` wraps them."""
    torn: TornTail | None = None

    def typed(self) -> list[CaptureRecord]:
        return [CaptureRecord(*r) for r in self.records]


# -- naming ---------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9_.@=+-]")


def safe_name(text: str) -> str:
    """A connection name usable in a file name (other characters become ``_``)."""
    return _UNSAFE.sub("_", text).strip(".")[:120] or "connection"


def new_run_id() -> str:
    """Unique enough per recorder: time in microseconds and the pid, in hex."""
    return f"{time.time_ns() // 1000:x}{os.getpid():05x}"


def segment_name(connection: str, direction: str, run_id: str, number: int) -> str:
    return f"{safe_name(connection)}.{direction}.{run_id}.{number:06d}{SUFFIX}"


# -- writing --------------------------------------------------------------------


def encode_header(meta: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(meta, use_bin_type=True)
    if len(packed) > MAX_METADATA_BYTES:
        raise ValueError(f"segment metadata of {len(packed)} bytes is over {MAX_METADATA_BYTES}")
    return _HEAD.pack(MAGIC, SCHEMA_VERSION, len(packed)) + packed


def encode_block(records: Sequence[Sequence[Any]], packer: msgpack.Packer | None = None) -> bytes:
    packer = packer or msgpack.Packer(use_bin_type=True)
    payload = b"".join(map(packer.pack, records))
    return _BLOCK.pack(len(payload), len(records), zlib.crc32(payload)) + payload


class SegmentWriter:
    """Appends records to size-rotated segments of one connection and direction.

    Blocking file I/O: the recorder calls it from a worker thread. The first
    segment is created on the first write (or on close, so that a connection
    that saw nothing still leaves an empty segment behind).
    """

    def __init__(
        self,
        directory: Path,
        *,
        side: str,
        connection: str,
        direction: str,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
        block_records: int = DEFAULT_BLOCK_RECORDS,
        extra: dict[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        if max_segment_bytes < 4096:
            raise ValueError("max_segment_bytes must be at least 4096")
        self.directory = Path(directory)
        self.side = side
        self.connection = connection
        self.direction = direction
        self.max_segment_bytes = max_segment_bytes
        self.block_records = max(1, block_records)
        self.extra = dict(extra or {})
        self.run_id = run_id or new_run_id()
        self.number = -1
        self.paths: list[Path] = []
        self.records_written = 0
        self.bytes_written = 0
        self._file: BinaryIO | None = None
        self._size = 0
        self._packer = msgpack.Packer(use_bin_type=True)

    def _meta(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "side": self.side,
            "connection": self.connection,
            "direction": self.direction,
            "run": self.run_id,
            "segment": self.number,
            "created": time.time(),
            **({"extra": self.extra} if self.extra else {}),
        }

    def _open_next(self) -> BinaryIO:
        self._close_file()
        self.number += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / segment_name(
            self.connection, self.direction, self.run_id, self.number
        )
        header = encode_header(self._meta())
        handle = _create_with_header(path, header)
        self._file, self._size = handle, len(header)
        self.bytes_written += len(header)
        self.paths.append(path)
        return handle

    def write(self, records: Sequence[Sequence[Any]]) -> None:
        """Append ``records`` in blocks, rotating between blocks past the size limit."""
        for start in range(0, len(records), self.block_records):
            block = encode_block(records[start : start + self.block_records], self._packer)
            handle = self._file
            if handle is None or self._size >= self.max_segment_bytes:
                handle = self._open_next()
            handle.write(block)
            self._size += len(block)
            self.bytes_written += len(block)
        self.records_written += len(records)
        if self._file is not None:
            self._file.flush()

    def _close_file(self, *, sync: bool = False) -> None:
        if self._file is None:
            return
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def close(self) -> None:
        if self.number < 0:
            self._open_next()
        self._close_file(sync=True)


def _create_with_header(path: Path, header: bytes) -> BinaryIO:
    """A new segment file that never appears without its header: a reader of a
    capture in progress (``read_capture``) would take an empty one for damage.
    Written under a name readers skip, then linked to ``path`` (which, like
    ``open(path, "xb")``, must not exist yet); the handle stays open for appends."""
    partial = path.with_name(path.name + ".partial")
    handle = open(partial, "xb")  # noqa: SIM115 - kept open across calls, closed in close()
    try:
        handle.write(header)
        handle.flush()
        try:
            os.link(partial, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: the name is unique anyway
            os.rename(partial, path)
            return handle
        os.unlink(partial)
    except BaseException:
        handle.close()
        partial.unlink(missing_ok=True)
        raise
    return handle


# -- reading --------------------------------------------------------------------


def decode_header(data: bytes, source: str = "segment") -> tuple[dict[str, Any], int]:
    """The metadata and the offset of the first block."""
    if len(data) < _HEAD.size:
        raise SegmentError(source, f"too short for a segment header ({len(data)} bytes)")
    magic, version, meta_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SegmentError(source, f"not a capture segment (magic {magic!r})", 0)
    if version != SCHEMA_VERSION:
        raise SegmentError(
            source, f"unsupported schema version {version} (this reader knows {SCHEMA_VERSION})"
        )
    if meta_len > MAX_METADATA_BYTES or _HEAD.size + meta_len > len(data):
        raise SegmentError(source, f"metadata length {meta_len} does not fit the file", 10)
    try:
        meta = msgpack.unpackb(data[_HEAD.size : _HEAD.size + meta_len], raw=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise SegmentError(source, f"metadata is not msgpack: {exc}", _HEAD.size) from None
    if not isinstance(meta, dict):
        raise SegmentError(source, "metadata is not a map", _HEAD.size)
    return meta, _HEAD.size + meta_len


def _records(payload: bytes | memoryview, source: str, offset: int) -> list[list[Any]]:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BLOCK_BYTES)
    unpacker.feed(payload)
    try:
        records = list(unpacker)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SegmentError(source, f"block is not msgpack records: {exc}", offset) from None
    _check_shapes(records, source, offset)
    return records


def _check_shapes(records: list[Any], source: str, offset: int) -> None:
    for index, record in enumerate(records):
        if not isinstance(record, list) or len(record) != FIELD_COUNT:
            raise SegmentError(
                source,
                f"record {index} of the block is not a {FIELD_COUNT}-field array: {record!r:.80}",
                offset,
            )


def _salvage(payload: bytes | memoryview) -> tuple[list[list[Any]], int]:
    """Whole records at the start of a cut-short payload, and the bytes they span."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BLOCK_BYTES)
    unpacker.feed(payload)
    kept: list[list[Any]] = []
    used = 0
    try:
        for record in unpacker:
            if not isinstance(record, list) or len(record) != FIELD_COUNT:
                break
            kept.append(record)
            used = unpacker.tell()
    except (ValueError, msgpack.UnpackException):
        pass
    return kept, used


def iter_blocks(
    data: bytes, source: str = "segment"
) -> Iterator[tuple[int, list[list[Any]] | TornTail]]:
    """(offset, records) per whole block, then at most one ``TornTail``.

    ``data`` is the whole segment, header included (checked here too).
    """
    _, offset = decode_header(data, source)
    view = memoryview(data)
    end = len(data)
    while offset < end:
        if end - offset < _BLOCK.size:
            yield offset, TornTail(offset, end - offset, 0, "block header cut short")
            return
        length, count, crc = _BLOCK.unpack_from(data, offset)
        body = offset + _BLOCK.size
        if length > MAX_BLOCK_BYTES:
            if body + length >= end:
                yield offset, TornTail(offset, end - offset, 0, f"block length {length} is bogus")
                return
            raise SegmentError(source, f"block length {length} over {MAX_BLOCK_BYTES}", offset)
        if body + length > end:
            kept, used = _salvage(view[body:end])
            lost = end - offset - used
            reason = f"block of {count} records cut short ({end - body} of {length} bytes)"
            if kept:
                yield offset, kept
            yield offset, TornTail(offset, lost, len(kept), reason)
            return
        payload = view[body : body + length]
        if zlib.crc32(payload) != crc:
            if body + length == end:
                yield offset, TornTail(offset, end - offset, 0, "last block fails its checksum")
                return
            raise SegmentError(source, "block fails its checksum", offset)
        records = _records(payload, source, offset)
        if len(records) != count:
            raise SegmentError(
                source, f"block says {count} records but holds {len(records)}", offset
            )
        yield offset, records
        offset = body + length


def decode_segment(data: bytes, source: str = "segment") -> CaptureSegment:
    meta, _ = decode_header(data, source)
    segment = CaptureSegment(meta)
    for _, got in iter_blocks(data, source):
        if isinstance(got, TornTail):
            segment.torn = got
        else:
            segment.records.extend(got)
    return segment


def read_segment(path: Path | str) -> CaptureSegment:
    with open(path, "rb") as handle:
        return decode_segment(handle.read(), str(path))


def list_segments(directory: Path | str) -> list[Path]:
    """The segment files under ``directory`` (recursively), in name order."""
    root = Path(directory)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob(f"*{SUFFIX}") if p.is_file())


def read_capture(directory: Path | str) -> Iterator[tuple[Path, CaptureSegment]]:
    """Every segment of a capture directory, in order (for tests and small tools)."""
    for path in list_segments(directory):
        yield path, read_segment(path)
