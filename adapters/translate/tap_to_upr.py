"""One vbucket of a TAP stream, turned into UPR history (the UPR front's ingest).

Theory of operation. A TAP producer sends items without sequence numbers,
grouped into a backfill (OPAQUE(INITIAL_VBUCKET_STREAM) ... OPAQUE(CLOSE_
BACKFILL)) and checkpoints (CHECKPOINT_START id ... CHECKPOINT_END id).
``TapToUpr`` gives every new version of a key the next by_seqno of the
vbucket and returns the records to append to the durable log: ``LogItem``s
(with kind, the TAP checkpoint, whether it came in the backfill) and
``LogMark``s for the stream structure. The only state is a small index,
key -> (latest seqno, cas, rev_seqno, expiration, deleted), the current
phase and checkpoint, and the high seqno. The index holds plain tuples of
ints (``version`` names the fields): CPython stops tracking such a tuple at
the first collection it survives, where a named tuple, a subclass, is walked
by every full collection for as long as it lives (one per key).

- Duplicates: a TAP producer resends what was not acknowledged (after a
  reconnect, a resume by checkpoint, a retransmit). A mutation or delete
  whose cas and rev_seqno equal the key's latest logged version is that
  same version again: it is skipped and keeps its seqno.
- Deletes: TAP has no expiration message. A DELETE of a key whose last
  mutation carried an expiration that is set and not after the delete's
  arrival (``now``, plus ``expiry_tolerance`` seconds for clock skew) is an
  EXPIRATION, anything else a DELETION.
- Upstream reset: OPAQUE(INITIAL_VBUCKET_STREAM) for a vbucket the log
  already holds (the node lost its state, or could not resume) starts a
  reconcile. Items of the new backfill that did not change are duplicates
  (kept seqnos), changed ones get new seqnos, and at CLOSE_BACKFILL every
  live key the backfill did not mention becomes a deletion. The history
  only moves forward, so consumers need no rollback.
- FLUSH deletes every live key.

``replay`` applies records read back from the log, rebuilding the same
state after a restart. A reconcile the log shows begun but not finished
cannot be resumed (the keys it had seen are not logged):
``reset_interrupted`` tells the ingest to ask for a fresh backfill.

Time enters as ``now`` (wall-clock epoch seconds, as TAP expirations are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from adapters.errors import ProtocolError
from adapters.mcbp.constants import VBucketState
from adapters.tap.constants import OpaqueCode, TapFlags, swap32
from adapters.tap.events import (
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapFlush,
    TapMutation,
    TapOpaque,
    TapStreamMessage,
    TapVbucketSet,
)
from adapters.translate.log_records import ItemKind, LogItem, LogMark, LogRecord, MarkKind

DEFAULT_EXPIRY_TOLERANCE = 1.0
_NETWORK_BYTE_ORDER = int(TapFlags.NETWORK_BYTE_ORDER)
_MUTATION = ItemKind.MUTATION
_tuple_new = tuple.__new__


class KeyVersion(NamedTuple):
    """A key's latest version, as ``TapToUpr.version`` names an index entry."""

    seqno: int
    cas: int
    rev_seqno: int
    expiration: int
    deleted: bool


Version = tuple[int, int, int, int, bool]
"""An index entry: the fields of ``KeyVersion`` in a plain tuple (see the module)."""
_SEQNO, _CAS, _REV, _EXPIRATION, _DELETED = range(5)


class TapToUpr:
    """Ingest state of one vbucket (see the module docstring)."""

    def __init__(
        self,
        vbucket: int,
        *,
        high_seqno: int = 0,
        expiry_tolerance: float = DEFAULT_EXPIRY_TOLERANCE,
    ) -> None:
        self.vbucket = vbucket
        self.high_seqno = high_seqno
        self.expiry_tolerance = expiry_tolerance
        self.index: dict[bytes, Version] = {}
        self.in_backfill = False
        self.backfilled = False
        """A backfill completed at least once (the log holds a whole vbucket)."""
        self.resetting: set[bytes] | None = None
        """Keys seen by the reconciling backfill (None: not reconciling)."""
        self.reset_interrupted = False
        self.checkpoint_id: int | None = None
        self.last_closed_checkpoint = 0
        self.state: VBucketState | None = None
        self.duplicates = 0
        self._checkpoint_start = False

    @property
    def live_keys(self) -> int:
        return sum(1 for v in self.index.values() if not v[_DELETED])

    def version(self, key: bytes) -> KeyVersion | None:
        """The latest version of ``key`` logged (None: never, or purged)."""
        found = self.index.get(key)
        return None if found is None else KeyVersion(*found)

    # -- feeding -------------------------------------------------------------

    def feed(self, message: TapStreamMessage, now: float) -> list[LogRecord]:
        """The log records of one TAP message of this vbucket."""
        if message.vbucket != self.vbucket:
            raise ProtocolError(
                f"message for vbucket {message.vbucket} fed to vbucket {self.vbucket}",
                field="vbucket",
                value=message.vbucket,
            )
        if type(message) is TapMutation:  # the common case first
            return self._mutation(message, now)
        if isinstance(message, TapDelete):
            return self._delete(message, now)
        if isinstance(message, TapCheckpointStart):
            return [self.checkpoint_start(message.checkpoint_id)]
        if isinstance(message, TapCheckpointEnd):
            return [self.checkpoint_end(message.checkpoint_id)]
        if isinstance(message, TapOpaque):
            return self._opaque(message, now)
        if isinstance(message, TapVbucketSet):
            self.state = message.state
            return [LogMark(MarkKind.STATE, int(message.state))]
        if isinstance(message, TapFlush):
            return self._delete_all(lambda key: True, now)
        raise ProtocolError(f"{message.NAME} has no place in a vbucket stream", field="opcode")

    def checkpoint_start(self, checkpoint_id: int) -> LogMark:
        """The mark of a TAP CHECKPOINT_START."""
        self.open_checkpoint(checkpoint_id)
        return LogMark(MarkKind.CHECKPOINT_START, checkpoint_id)

    def checkpoint_end(self, checkpoint_id: int) -> LogMark:
        """The mark of a TAP CHECKPOINT_END."""
        self.close_checkpoint(checkpoint_id)
        return LogMark(MarkKind.CHECKPOINT_END, checkpoint_id)

    def open_checkpoint(self, checkpoint_id: int) -> None:
        """What a CHECKPOINT_START changes (``tap_to_log_fast`` frames the mark itself)."""
        self.checkpoint_id = checkpoint_id
        self._checkpoint_start = True

    def close_checkpoint(self, checkpoint_id: int) -> None:
        """What a CHECKPOINT_END changes (``tap_to_log_fast`` frames the mark itself)."""
        self.checkpoint_id = None
        self._checkpoint_start = False
        self.last_closed_checkpoint = checkpoint_id

    def _opaque(self, message: TapOpaque, now: float) -> list[LogRecord]:
        code = message.opaque_code
        if code == OpaqueCode.INITIAL_VBUCKET_STREAM:
            reset = any(not v[_DELETED] for v in self.index.values())
            self.in_backfill = True
            self.resetting = set() if reset else None
            self.reset_interrupted = False
            self.checkpoint_id = None
            return [LogMark(MarkKind.BACKFILL_START, int(reset))]
        if code == OpaqueCode.CLOSE_BACKFILL:
            out: list[LogRecord] = []
            seen = self.resetting
            if seen is not None:
                out = self._delete_all(lambda key: key not in seen, now)
            self.resetting = None
            self.in_backfill = False
            self.backfilled = True
            out.append(LogMark(MarkKind.BACKFILL_END))
            return out
        return []  # auto nack, checkpoint sync, ...: stream settings, no history

    def _next(self) -> int:
        self.high_seqno += 1
        return self.high_seqno

    def _origin(self) -> tuple[int, bool, bool]:
        first = self._checkpoint_start and not self.in_backfill
        self._checkpoint_start = False
        return (0 if self.in_backfill else self.checkpoint_id or 0), self.in_backfill, first

    def _mutation(self, m: TapMutation, now: float) -> list[LogRecord]:
        item = self.mutation(
            m.key, m.value, m.cas, m.flags, m.expiration, m.rev_seqno, m.datatype,
            int(m.tap_flags), now,
        )  # fmt: skip
        return [] if item is None else [item]

    def mutation(
        self,
        key: bytes,
        value: bytes,
        cas: int,
        flags: int,
        expiration: int,
        rev_seqno: int | None,
        datatype: int,
        tap_flags: int,
        now: float,
    ) -> LogItem | None:
        """The log item of one TAP mutation's fields (None: a duplicate, skipped).

        Shared by ``feed`` and the ingest's fast path (``tap_to_log_fast``).
        """
        if self.resetting is not None:
            self.resetting.add(key)
        old = self.index.get(key)
        rev = rev_seqno if rev_seqno is not None else (old[_REV] + 1 if old else 1)
        if old is not None and not old[_DELETED] and old[_CAS] == cas and old[_REV] == rev:
            self.duplicates += 1
            return None
        if not tap_flags & _NETWORK_BYTE_ORDER:
            flags = swap32(flags)
        # ``_origin`` inline (once per item)
        backfill = self.in_backfill
        if backfill:
            checkpoint, first = 0, False
        else:
            checkpoint, first = self.checkpoint_id or 0, self._checkpoint_start
        self._checkpoint_start = False
        self.high_seqno = seqno = self.high_seqno + 1
        self.index[key] = (seqno, cas, rev, expiration, False)
        # tuple.__new__: a named tuple's own constructor is a Python call (per item).
        return _tuple_new(LogItem, (
            seqno, _MUTATION, key, value, rev, cas, flags, expiration, 0, datatype,
            checkpoint, backfill, first, now, 0,
        ))  # fmt: skip

    def _delete(self, d: TapDelete, now: float) -> list[LogRecord]:
        item = self.delete(d.key, d.cas, d.rev_seqno, now)
        return [] if item is None else [item]

    def delete(self, key: bytes, cas: int, rev_seqno: int | None, now: float) -> LogItem | None:
        """The log item of one TAP delete's fields (None: a duplicate, skipped)."""
        if self.resetting is not None:
            self.resetting.add(key)
        old = self.index.get(key)
        rev = rev_seqno if rev_seqno is not None else (old[_REV] + 1 if old else 1)
        if old is not None and old[_DELETED] and old[_CAS] == cas and old[_REV] == rev:
            self.duplicates += 1
            return None
        return self._tombstone(key, old, cas, rev, now)

    def _tombstone(
        self, key: bytes, old: Version | None, cas: int, rev: int, now: float
    ) -> LogItem:
        expired = (
            old is not None
            and not old[_DELETED]
            and 0 < old[_EXPIRATION] <= now + self.expiry_tolerance
        )
        checkpoint, backfill, first = self._origin()
        item = LogItem(
            self._next(),
            ItemKind.EXPIRATION if expired else ItemKind.DELETION,
            key,
            b"",
            rev,
            cas,
            0,
            0,
            0,
            0,
            checkpoint,
            backfill,
            first,
            now,
            int(now),
        )
        self.index[key] = (item.by_seqno, cas, rev, 0, True)
        return item

    def _delete_all(self, doomed: Callable[[bytes], bool], now: float) -> list[LogRecord]:
        victims = [(key, v) for key, v in self.index.items() if not v[_DELETED] and doomed(key)]
        return [self._tombstone(key, v, v[_CAS], v[_REV] + 1, now) for key, v in victims]

    # -- restoring -----------------------------------------------------------

    def replay(self, record: LogRecord) -> None:
        """Apply a record read back from the log (in log order)."""
        if isinstance(record, LogItem):
            if record.by_seqno > self.high_seqno:
                self.high_seqno = record.by_seqno
            self.index[record.key] = (
                record.by_seqno,
                record.cas,
                record.rev_seqno,
                record.expiration,
                record.kind is not _MUTATION,
            )
            return
        kind, value = record.kind, record.value
        if kind is MarkKind.BACKFILL_START:
            self.in_backfill = True
            self.reset_interrupted = bool(value)
            self.checkpoint_id = None
        elif kind is MarkKind.BACKFILL_END:
            self.in_backfill = False
            self.reset_interrupted = False
            self.backfilled = True
        elif kind is MarkKind.CHECKPOINT_START:
            self.checkpoint_id = value
        elif kind is MarkKind.CHECKPOINT_END:
            self.checkpoint_id = None
            self.last_closed_checkpoint = value
        elif kind is MarkKind.STATE:
            self.state = VBucketState(value)

    def forget(self, key: bytes, seqno: int) -> None:
        """Compaction purged the tombstone at ``seqno``: drop the key if it is still that."""
        version = self.index.get(key)
        if version is not None and version[_DELETED] and version[_SEQNO] == seqno:
            del self.index[key]
