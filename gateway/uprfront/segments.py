"""Segment files of the UPR front's log: length + crc framed msgpack records.

A record on disk is ``length u32, crc32 u32, payload``, the payload a
msgpack list (``adapters.translate.log_records.to_row``, or a segment header
row). ``scan`` reads a file front to back and stops at the first record
that is short or fails its crc: a torn tail left by a crash. The caller
truncates the file there before appending again.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

FRAME = struct.Struct(">II")
MAX_RECORD = 64 * 1024 * 1024
HEADER_ROW = 2
"""Row tag of a compacted segment's header: [2, covers_upto_seqno]."""

_packer = msgpack.Packer(use_bin_type=True)


def frame(row: list[Any]) -> bytes:
    payload: bytes = _packer.pack(row)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def scan(
    path: Path, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, int, list[Any]]]:
    """(offset, end offset, row) of each whole record from ``start`` to ``stop``.

    Stops quietly at a torn record; ``scan_end`` tells where the good part ends.
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
        except Exception:  # a crc collision on garbage: treat as torn
            return
        if not isinstance(row, list) or not row:
            return
        yield base + offset, base + body + length, row
        offset = body + length


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
