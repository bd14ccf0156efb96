"""Checkpoints: numbered, contiguous seqno ranges of one vbucket's writes.

Every write goes into the open checkpoint and records its id. The open
checkpoint is closed (and the next id opened) once it holds ``max_items``
items, or once ``max_seconds`` have passed since its first item; time comes
in as ``now`` on each write and from periodic ``maybe_close(now)`` calls. An
empty checkpoint never closes on time, so an idle vbucket does not burn ids.

Only metadata is kept: (id, start, end) of the last ``history`` closed
checkpoints and of the open one. Items themselves live once per key in the
vbucket (deduplicated), so a closed range may hold fewer live items than it
once received. Streams cut memory snapshots along these ranges, and TAP
sends their ids in CHECKPOINT_START/END.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

DEFAULT_MAX_ITEMS = 500
DEFAULT_MAX_SECONDS = 5.0
DEFAULT_HISTORY = 1000


@dataclass(frozen=True, slots=True)
class Checkpoint:
    id: int
    start_seqno: int
    end_seqno: int
    """Last seqno written into it; ``start_seqno - 1`` while it is empty."""
    open: bool = False


_START = attrgetter("start_seqno")


class Checkpoints:
    """One vbucket's checkpoint bookkeeping."""

    __slots__ = (
        "_closed",
        "_count",
        "_end",
        "_first_at",
        "_id",
        "_start",
        "max_items",
        "max_seconds",
    )

    def __init__(
        self,
        *,
        max_items: int = DEFAULT_MAX_ITEMS,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        history: int = DEFAULT_HISTORY,
        next_id: int = 1,
        high_seqno: int = 0,
    ) -> None:
        self.max_items = max_items
        self.max_seconds = max_seconds
        # Bounded: a deque drops the oldest ranges; bisect still works on it.
        self._closed: deque[Checkpoint] = deque(maxlen=history)
        self._id = next_id
        self._start = high_seqno + 1
        self._end = high_seqno
        self._count = 0
        self._first_at: float | None = None

    @property
    def open_id(self) -> int:
        return self._id

    @property
    def open_checkpoint(self) -> Checkpoint:
        return Checkpoint(self._id, self._start, self._end, open=True)

    @property
    def last_closed_id(self) -> int:
        return self._closed[-1].id if self._closed else 0

    def listing(self) -> list[Checkpoint]:
        """Retained closed checkpoints, oldest first, then the open one."""
        return [*self._closed, self.open_checkpoint]

    def before_write(self, now: float) -> int:
        """Close the open checkpoint if it is due; the id the next write goes into."""
        self.maybe_close(now)
        return self._id

    def wrote(self, seqno: int, now: float) -> None:
        """Record that ``seqno`` went into the open checkpoint."""
        if self._count == 0:
            self._first_at = now
            self._start = seqno
        self._end = seqno
        self._count += 1
        if self._count >= self.max_items:
            self.close()

    def maybe_close(self, now: float) -> bool:
        """Close the open checkpoint if its time is up; whether it closed."""
        if self._first_at is not None and now - self._first_at >= self.max_seconds:
            self.close()
            return True
        return False

    def close(self, next_id: int | None = None) -> int:
        """Close the open checkpoint and open the next; returns the new open id.

        ``next_id`` lets a replica follow its source's ids (TAP CHECKPOINT_START);
        ids only ever grow, so a smaller one is ignored. An empty open
        checkpoint is renumbered rather than recorded.
        """
        new_id = max(self._id + 1, next_id or 0)
        if self._count:
            self._closed.append(Checkpoint(self._id, self._start, self._end))
            self._start = self._end + 1
        self._id = new_id
        self._count = 0
        self._first_at = None
        return new_id

    def containing(self, seqno: int) -> Checkpoint | None:
        """The checkpoint whose range holds ``seqno``.

        The open checkpoint holds every seqno from its start on (including
        ones not written yet). ``None``: older than the retained history, so
        a stream must read it as a disk snapshot.
        """
        if seqno >= self._start:
            return self.open_checkpoint
        closed = self._closed
        index = bisect_right(closed, seqno, key=_START) - 1
        if index < 0:
            return None
        found = closed[index]
        return found if seqno <= found.end_seqno else None

    def rollback(self, seqno: int) -> None:
        """Forget ranges past ``seqno`` and open a fresh checkpoint after it."""
        closed = self._closed
        while closed and closed[-1].start_seqno > seqno:
            closed.pop()
        if closed and closed[-1].end_seqno > seqno:
            last = closed.pop()
            closed.append(Checkpoint(last.id, last.start_seqno, seqno))
        if self._count and self._start <= seqno:
            self._end = min(self._end, seqno)  # what is left of it gets recorded
        else:
            self._count = 0
        self.close()
        self._start = seqno + 1
        self._end = seqno
