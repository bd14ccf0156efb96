"""One vbucket's failover log: uuids handed out, entries added and pruned.

The one implementation for every vbucket here: the reference node's and the
UPR front's logs. The wire form of a log (``FailoverEntries``) is in
``adapters.upr.failover``; the rollback rule over it in
``adapters.upr.rollback``.

A failover log is a list of (uuid, seqno) pairs, newest first: each entry
says "from this seqno on, history is the one named by this uuid". A vbucket
gets a new entry whenever it cannot prove its history continues the previous
one: it becomes active, someone forces a failover, or it restarts. Its uuid
is the newest entry's. A consumer presents (uuid, position, snapshot) and
``rollback_decision`` says whether, and how far, it must roll back first.

Seqnos never decrease toward the newest entry: a rollback prunes entries
newer than the point it returns to. 3.0 keeps at most 25 entries of 48-bit
uuids; both limits are enforced here.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from adapters.upr.failover import FailoverEntries
from adapters.upr.rollback import rollback_decision

__all__ = ["MAX_ENTRIES", "UUID_BITS", "FailoverLog", "rollback_decision"]

MAX_ENTRIES = 25
UUID_BITS = 48


class FailoverLog:
    """One vbucket's failover log, newest first, bounded to ``MAX_ENTRIES``."""

    __slots__ = ("_entries", "_rng")

    def __init__(self, rng: random.Random, entries: Iterable[tuple[int, int]] = ()) -> None:
        self._rng = rng
        self._entries: list[tuple[int, int]] = [(int(u), int(s)) for u, s in entries]
        del self._entries[MAX_ENTRIES:]

    @property
    def entries(self) -> FailoverEntries:
        return tuple(self._entries)

    @property
    def uuid(self) -> int:
        return self._entries[0][0] if self._entries else 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, seqno: int) -> int:
        """Start a new history at ``seqno`` under a fresh uuid; return the uuid."""
        # An entry beyond seqno would describe a history we no longer have.
        self.prune(seqno)
        uuid = self._new_uuid()
        self._entries.insert(0, (uuid, seqno))
        del self._entries[MAX_ENTRIES:]
        return uuid

    def prune(self, seqno: int) -> None:
        """Drop entries that begin after ``seqno`` (after a rollback to it)."""
        while self._entries and self._entries[0][1] > seqno:
            del self._entries[0]

    def replace(self, entries: Iterable[tuple[int, int]]) -> None:
        """Adopt a producer's log, as a 3.0 consumer does on stream accept."""
        self._entries = [(int(u), int(s)) for u, s in entries][:MAX_ENTRIES]

    def decide(
        self, high_seqno: int, start: int, uuid: int, snap_start: int, snap_end: int
    ) -> int | None:
        return rollback_decision(self._entries, high_seqno, start, uuid, snap_start, snap_end)

    def _new_uuid(self) -> int:
        taken = {u for u, _ in self._entries}
        while True:
            # Zero means "no history" to consumers (stream from scratch); never hand it out.
            uuid = self._rng.getrandbits(UUID_BITS)
            if uuid and uuid not in taken:
                return uuid
