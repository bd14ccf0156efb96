"""Capture records: one item event or stream boundary as a compact tuple.

A record is what one connection, in one direction, saw of one message that
matters to reconciliation: items (mutation, deletion, expiration, or a
delete whose cause the protocol does not tell) and the boundaries that
frame them (snapshot markers, checkpoints, backfill start/end, stream end).
Records are msgpack arrays in the field order of ``CaptureRecord``; the
schema version in each segment header says which order that is.

Item values are not kept, only a 16-byte BLAKE2b digest, so captures stay
small and comparable without holding user data.
"""

from __future__ import annotations

import enum
from hashlib import blake2b
from typing import NamedTuple

SCHEMA_VERSION = 1
DIGEST_SIZE = 16


class Kind(enum.IntEnum):
    """What a record stands for; items below 10, boundaries from 10 on."""

    MUTATION = 1
    DELETION = 2
    EXPIRATION = 3
    DELETE = 4
    """A delete whose cause the protocol does not tell (TAP DELETE; a 3.0 DELETION
    on a connection that could not enable the expiry opcode)."""
    SNAPSHOT = 10
    """UPR snapshot marker with its range (``snap_start``..``snap_end``) and flags."""
    SNAPSHOT_START = 11
    """Draft UPR: a snapshot begins (no range travels)."""
    SNAPSHOT_END = 12
    CHECKPOINT_START = 13
    CHECKPOINT_END = 14
    BACKFILL_START = 15
    """TAP OPAQUE(initial vbucket stream)."""
    BACKFILL_END = 16
    """TAP OPAQUE(close backfill)."""
    STREAM_END = 17
    CUT = 18
    """Where a two-sided capture cut this vbucket: every change with a CAS at or below
    ``cas`` is inside the cut (``gateway.tools.capture.cut``); ``by_seqno`` is the highest
    seqno the side had recorded when it stopped (0 for TAP)."""

    @property
    def is_item(self) -> bool:
        return self < 10

    @property
    def label(self) -> str:
        return self.name.lower()


ITEM_KINDS = frozenset(k for k in Kind if k.is_item)
DELETE_KINDS = frozenset({Kind.DELETION, Kind.EXPIRATION, Kind.DELETE})
KIND_BY_LABEL = {k.label: k for k in Kind}


def parse_kind(kind: Kind | str | int) -> Kind:
    """A ``Kind`` from itself, its label (``"mutation"``) or its number."""
    if isinstance(kind, Kind):
        return kind
    if isinstance(kind, str):
        try:
            return KIND_BY_LABEL[kind.lower()]
        except KeyError:
            raise ValueError(
                f"unknown record kind {kind!r} (expected one of {', '.join(KIND_BY_LABEL)})"
            ) from None
    return Kind(kind)


class CaptureRecord(NamedTuple):
    """One record, in its on-disk field order (schema version 1)."""

    kind: int
    vbucket: int
    key: bytes
    by_seqno: int | None
    """``None`` where the protocol has none (TAP)."""
    rev_seqno: int | None
    cas: int
    flags: int
    """Item flags in network byte order, as stored."""
    expiration: int
    digest: bytes | None
    """BLAKE2b-128 of the value; ``None`` for deletes and boundaries."""
    checkpoint_id: int | None
    """TAP: the checkpoint the item came in (``None`` in backfill) or a marker's id."""
    snap_start: int | None
    """UPR: the range of the snapshot the item came in, or a marker's range."""
    snap_end: int | None
    marker_flags: int
    """Snapshot marker flags; STREAM_END reason."""
    arrival: float
    """Wall-clock seconds when the message was seen."""


FIELDS = CaptureRecord._fields
FIELD_COUNT = len(FIELDS)


def digest(value: bytes) -> bytes:
    return blake2b(value, digest_size=DIGEST_SIZE).digest()


def item_record(
    vbucket: int,
    key: bytes,
    kind: Kind | str,
    *,
    by_seqno: int | None,
    rev_seqno: int | None,
    cas: int,
    flags: int = 0,
    expiration: int = 0,
    value: bytes | None = None,
    checkpoint_id: int | None = None,
    snapshot: tuple[int, int] | None = None,
    arrival: float,
) -> CaptureRecord:
    """The record of one item event; ``value`` is digested (deletes keep none)."""
    kind = parse_kind(kind)
    if not kind.is_item:
        raise ValueError(f"{kind.label} is a boundary, not an item kind")
    snap_start, snap_end = snapshot if snapshot is not None else (None, None)
    return CaptureRecord(
        int(kind),
        vbucket,
        key,
        by_seqno,
        rev_seqno,
        cas,
        flags,
        expiration,
        digest(value) if value is not None and kind == Kind.MUTATION else None,
        checkpoint_id,
        snap_start,
        snap_end,
        0,
        arrival,
    )


def cut_record(vbucket: int, *, cas: int, seqno: int, arrival: float) -> CaptureRecord:
    """The CUT boundary of one vbucket (see ``Kind.CUT``)."""
    return CaptureRecord(
        int(Kind.CUT), vbucket, b"", seqno, None, cas, 0, 0, None, None, None, None, 0, arrival
    )


def marker_record(
    vbucket: int,
    kind: Kind | str,
    *,
    checkpoint_id: int | None = None,
    snapshot: tuple[int, int] | None = None,
    flags: int = 0,
    arrival: float,
) -> CaptureRecord:
    """The record of one boundary (snapshot, checkpoint, backfill, stream end)."""
    kind = parse_kind(kind)
    if kind.is_item:
        raise ValueError(f"{kind.label} is an item kind, not a boundary")
    snap_start, snap_end = snapshot if snapshot is not None else (None, None)
    return CaptureRecord(
        int(kind),
        vbucket,
        b"",
        None,
        None,
        0,
        0,
        0,
        None,
        checkpoint_id,
        snap_start,
        snap_end,
        flags,
        arrival,
    )
