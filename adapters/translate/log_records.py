"""What the UPR front's durable log holds: items with gateway seqnos, and marks.

``LogItem`` is one version of one key in one vbucket, as a UPR consumer will
receive it: a mutation, a deletion or an expiration with the by_seqno the
gateway assigned. ``LogMark`` records what happened to the TAP stream
between items (a backfill began or closed, a checkpoint closed, the
vbucket changed state); marks take no seqno, but replaying them rebuilds
the ingest state (``TapToUpr.replay``) after a restart.

``to_row``/``from_row`` give the plain lists the log stores as msgpack.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

from adapters.upr.items import ItemKind as ItemKind  # its home is adapters.upr.items


class MarkKind(IntEnum):
    BACKFILL_START = 1
    """OPAQUE(INITIAL_VBUCKET_STREAM); value 1 when it resets a vbucket the log held."""
    BACKFILL_END = 2
    """OPAQUE(CLOSE_BACKFILL)."""
    CHECKPOINT_START = 3
    CHECKPOINT_END = 4
    """value: the checkpoint id, the last closed one resumes the TAP stream."""
    STATE = 5
    """value: the vbucket state the TAP node announced (VBUCKET_SET)."""


class LogItem(NamedTuple):
    """One logged version of a key (immutable).

    A named tuple rather than a frozen dataclass: the ingest builds one per
    TAP item and every stream one per item it reads back, and a tuple is
    built five times faster.
    """

    by_seqno: int
    kind: ItemKind
    key: bytes
    value: bytes = b""
    rev_seqno: int = 0
    cas: int = 0
    flags: int = 0
    """Item flags in network order, as stored."""
    expiration: int = 0
    lock_time: int = 0
    datatype: int = 0
    checkpoint_id: int = 0
    """The TAP checkpoint it came in (0: the backfill)."""
    backfill: bool = False
    """Came in a TAP backfill (served in DISK snapshots)."""
    checkpoint_start: bool = False
    """First item logged after a TAP CHECKPOINT_START (its marker gets CHECKPOINT)."""
    arrival: float = 0.0
    """Wall-clock seconds it entered the log (for latency figures)."""
    delete_time: int = 0
    """Epoch seconds of the delete (deletions and expirations)."""

    @property
    def deleted(self) -> bool:
        return self.kind is not ItemKind.MUTATION


@dataclass(frozen=True, slots=True)
class LogMark:
    kind: MarkKind
    value: int = 0


LogRecord = LogItem | LogMark

BLOCK_ITEM = struct.Struct(">QBBBHIQQIIIQdI")
"""An item in a block of the log (``gateway.fronts.upr.segments``): by_seqno, kind,
bits (backfill 1, checkpoint_start 2), datatype, key length, value length,
rev_seqno, cas, flags, expiration, lock_time, checkpoint_id, arrival,
delete_time; then the key and the value."""

_ITEM, _MARK = 0, 1
_KINDS = {kind.value: kind for kind in ItemKind}
_MARKS = {kind.value: kind for kind in MarkKind}


def to_row(record: LogRecord) -> list[object]:
    """A plain list for msgpack (bytes stay bytes)."""
    if type(record) is LogItem:
        (seqno, kind, key, value, rev, cas, flags, exp, lock, dtype, cp, bf, cs, arr, dt) = record
        # int(): an enum's ``.value`` is a slow descriptor (once per logged item).
        return [_ITEM, seqno, int(kind), key, value, rev, cas, flags, exp, lock, dtype, cp,
                bf | cs << 1, arr, dt]  # fmt: skip
    if isinstance(record, LogMark):
        return [_MARK, record.kind.value, record.value]
    raise TypeError(f"not a log record: {record!r:.80}")


def from_row(row: list[Any]) -> LogRecord:
    """The record of ``to_row``; ``ValueError`` for anything else.

    Rows come crc-checked from the log's own writer, so fields are taken as
    msgpack gave them (ints, bytes, a float); only the shape and the kind
    are checked.
    """
    try:
        if row[0] == _ITEM and len(row) == 15:
            (_, seqno, kind, key, value, rev, cas, flags, exp, lock, dtype, cp, bits, arr, dt) = row
            return LogItem(seqno, _KINDS[kind], key, value, rev, cas, flags, exp, lock, dtype,
                           cp, bits & 1 == 1, bits & 2 == 2, arr, dt)  # fmt: skip
        if row[0] == _MARK:
            return LogMark(_MARKS[row[1]], int(row[2]))
        raise ValueError(f"not a log record: {row!r:.80}")
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a log record: {row!r:.80}") from exc
