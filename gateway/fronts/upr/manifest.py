"""The state directory's manifest of the UPR front's logs: which vbuckets exist, and bounds.

``upr-front-logs.msgpack`` (crc-framed msgpack, replaced atomically) lists
every vbucket that has a log, with its seqno reservation and the uuids its
histories have had. It is the second copy of what must survive the loss
of a vbucket directory or its meta: that the vbucket existed (a missing
directory is then a loss, not a new vbucket), a seqno at or above every
one it handed out (the log set rewrites the manifest whenever a log's
reservation moves up, before the seqnos above the old one are published),
and the uuids a new history must not take.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from gateway.fronts.upr.segments import FRAME
from gateway.runtime.files import write_atomic

MANIFEST_NAME = "upr-front-logs.msgpack"
MANIFEST_FORMAT = 1
MAX_UUIDS = 64
"""Uuids remembered per vbucket (the newest; a failover log holds at most 25)."""


@dataclass
class KnownVb:
    reserved: int = 0
    uuids: list[int] = field(default_factory=list)
    """Oldest first."""

    def remember(self, reserved: int, uuids: list[int]) -> None:
        self.reserved = max(self.reserved, reserved)
        for uuid in uuids:
            if uuid not in self.uuids:
                self.uuids.append(uuid)
        del self.uuids[:-MAX_UUIDS]


def pack_manifest(known: dict[int, KnownVb]) -> bytes:
    rows = [[vb, k.reserved, k.uuids] for vb, k in sorted(known.items())]
    payload: bytes = msgpack.packb({"format": MANIFEST_FORMAT, "vbuckets": rows}, use_bin_type=True)
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def unpack_manifest(data: bytes) -> dict[int, KnownVb]:
    """The manifest in ``data``; ``ValueError`` saying what is wrong with it."""
    if len(data) < FRAME.size:
        raise ValueError(f"{len(data)} bytes, shorter than its header")
    length, crc = FRAME.unpack_from(data)
    payload = data[FRAME.size :]
    if length != len(payload) or zlib.crc32(payload) != crc:
        raise ValueError("fails its length or crc check")
    try:
        obj = msgpack.unpackb(payload, raw=False)
        if obj["format"] != MANIFEST_FORMAT:
            raise TypeError
        out = {}
        for vb, reserved, uuids in obj["vbuckets"]:
            if not all(type(n) is int and n >= 0 for n in (vb, reserved, *uuids)):
                raise TypeError
            out[vb] = KnownVb(reserved, list(uuids))
    except (ValueError, KeyError, TypeError):
        raise ValueError("not a manifest map") from None
    return out


def read_manifest(path: Path) -> tuple[dict[int, KnownVb] | None, str | None]:
    """(entries, None), or (None, what is wrong): "missing" or "damaged: ..."."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, "missing"
    try:
        return unpack_manifest(data), None
    except ValueError as exc:
        return None, f"damaged: {exc}"


def write_manifest(path: Path, known: dict[int, KnownVb]) -> None:
    write_atomic(path, pack_manifest(known))
