"""Log items to UPR snapshots and stream messages (the UPR front's serving side).

Theory of operation. A stream reads the durable log in bounded batches of
``LogItem``s, in seqno order. ``cut_snapshots`` splits a batch into
snapshots, each sent as one SNAPSHOT_MARKER whose start and end are exactly
the seqnos of its first and last item, followed by those items. A snapshot
ends where the batch ends and before an item that

- changes origin (TAP backfill items form DISK snapshots, live items
  MEMORY ones),
- belongs to another TAP checkpoint, or starts one (``checkpoint_start``:
  that snapshot's marker carries CHECKPOINT),
- repeats a key already in the snapshot (the log keeps every version; a
  snapshot holds each key at most once).

``item_event`` gives the UPR message of one item: deletions and expirations
both travel as DELETION unless the consumer asked for the expiry opcode,
and carry a delete time only for consumers that asked for delete times.
``ItemEncoder`` gives the same message's wire bytes straight from the item
(one struct pack, no event object): the serving hot path. It produces
exactly ``upr.encode(item_event(...))``; the property tests hold it to that.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from adapters.mcbp.constants import Magic
from adapters.mcbp.frames import HEADER
from adapters.translate.log_records import ItemKind, LogItem
from adapters.upr.codec import encode
from adapters.upr.constants import Command, SnapshotFlags
from adapters.upr.dialect import Dialect, ItemLayout
from adapters.upr.events import Deletion, Expiration, Mutation
from adapters.upr.items import StoredItem

NO_FLAGS = SnapshotFlags(0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    start: int
    end: int
    flags: SnapshotFlags
    items: tuple[LogItem, ...]


def _flags(first: LogItem, extra: SnapshotFlags) -> SnapshotFlags:
    if first.backfill:
        return SnapshotFlags.DISK | extra
    if first.checkpoint_start:
        return SnapshotFlags.MEMORY | SnapshotFlags.CHECKPOINT | extra
    return SnapshotFlags.MEMORY | extra


def cut_snapshots(items: Sequence[LogItem], *, extra: SnapshotFlags = NO_FLAGS) -> list[Snapshot]:
    """Split seqno-ordered ``items`` into snapshots (see the module docstring).

    ``extra`` is added to every marker's flags (ACK for a takeover stream).
    """
    out: list[Snapshot] = []
    run: list[LogItem] = []
    keys: set[bytes] = set()

    def close() -> None:
        if run:
            out.append(
                Snapshot(run[0].by_seqno, run[-1].by_seqno, _flags(run[0], extra), tuple(run))
            )

    for item in items:
        if run:
            head = run[-1]
            if (
                item.backfill != head.backfill
                or item.checkpoint_id != head.checkpoint_id
                or (item.checkpoint_start and not item.backfill)
                or item.key in keys
            ):
                close()
                run, keys = [], set()
        run.append(item)
        keys.add(item.key)
    close()
    return out


def item_event(
    item: StoredItem,
    opaque: int,
    vbucket: int,
    *,
    expiry_opcode: bool = False,
    delete_times: bool = False,
) -> Mutation | Deletion | Expiration:
    """The stream message of one logged item."""
    if item.kind is ItemKind.MUTATION:
        return Mutation(
            key=item.key,
            value=item.value,
            by_seqno=item.by_seqno,
            rev_seqno=item.rev_seqno,
            flags=item.flags,
            expiration=item.expiration,
            lock_time=item.lock_time,
            cas=item.cas,
            datatype=item.datatype,
            opaque=opaque,
            vbucket=vbucket,
        )
    cls = Expiration if expiry_opcode and item.kind is ItemKind.EXPIRATION else Deletion
    return cls(
        key=item.key,
        by_seqno=item.by_seqno,
        rev_seqno=item.rev_seqno,
        delete_time=item.delete_time if delete_times else None,
        cas=item.cas,
        opaque=opaque,
        vbucket=vbucket,
    )


_REQUEST = Magic.REQUEST.value


def _layout(layouts: tuple[ItemLayout, ...], delete_time: bool) -> ItemLayout | None:
    return next((x for x in layouts if x.delete_time == delete_time), None)


class ItemEncoder:
    """Wire bytes of logged items for one stream (opaque, vbucket, consumer settings).

    Header and extras are packed in one call of a struct made of both;
    key and value follow. Anything the fast path does not cover (a key the
    encoder would refuse, a dialect without the layout asked for, a number
    too large for its field) goes through ``upr.encode(item_event(...))``,
    which raises the codec's own error.
    """

    __slots__ = ("_deletion", "_dialect", "_expiration", "_mutation", "_settings", "opaque",
                 "vbucket")  # fmt: skip

    def __init__(
        self,
        dialect: Dialect,
        opaque: int,
        vbucket: int,
        *,
        expiry_opcode: bool = False,
        delete_times: bool = False,
    ) -> None:
        self._dialect = dialect
        self.opaque = opaque
        self.vbucket = vbucket
        self._settings = (expiry_opcode, delete_times)
        opcodes = dialect.opcodes
        mutation = dialect.mutation
        self._mutation = (
            opcodes[Command.MUTATION],
            struct.Struct(HEADER.format + mutation.extras.format.lstrip(">")),
            mutation.extras.size,
            mutation.meta,
        )
        self._deletion = self._removal(opcodes.get(Command.DELETION), dialect.deletion)
        self._expiration = (
            self._removal(opcodes.get(Command.EXPIRATION), dialect.expiration)
            if expiry_opcode
            else self._deletion
        )

    def _removal(
        self, opcode: int | None, layouts: tuple[ItemLayout, ...]
    ) -> tuple[int, struct.Struct, int, bool, bool] | None:
        layout = _layout(layouts, self._settings[1])
        if opcode is None or layout is None:
            return None
        fmt = struct.Struct(HEADER.format + layout.extras.format.lstrip(">"))
        return opcode, fmt, layout.extras.size, layout.meta, layout.delete_time

    def encode(self, item: LogItem) -> bytes:
        key = item.key
        try:
            if item.kind is ItemKind.MUTATION:
                opcode, fmt, extras, meta = self._mutation
                value = item.value
                if not key:
                    raise struct.error("empty key")
                head = (_REQUEST, opcode, len(key), extras, item.datatype, self.vbucket,
                        extras + len(key) + len(value), self.opaque, item.cas, item.by_seqno,
                        item.rev_seqno, item.flags, item.expiration, item.lock_time)  # fmt: skip
                packed = fmt.pack(*head, 0, 0) if meta else fmt.pack(*head)
                return packed + key + value
            removal = self._expiration if item.kind is ItemKind.EXPIRATION else self._deletion
            if removal is None or not key:
                raise struct.error("no fast path")
            opcode, fmt, extras, meta, delete_time = removal
            gone = (_REQUEST, opcode, len(key), extras, 0, self.vbucket, extras + len(key),
                    self.opaque, item.cas, item.by_seqno, item.rev_seqno)  # fmt: skip
            if meta:
                return fmt.pack(*gone, 0) + key
            if delete_time:
                return fmt.pack(*gone, item.delete_time) + key
            return fmt.pack(*gone) + key
        except struct.error:
            expiry_opcode, delete_times = self._settings
            event = item_event(item, self.opaque, self.vbucket, expiry_opcode=expiry_opcode,
                               delete_times=delete_times)  # fmt: skip
            return encode(event, self._dialect)
