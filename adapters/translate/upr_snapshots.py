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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adapters.translate.log_records import ItemKind, LogItem
from adapters.upr.constants import SnapshotFlags
from adapters.upr.events import Deletion, Expiration, Mutation

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
    item: LogItem,
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
