"""The history of one vbucket's log, without I/O: failover log, seqno reservation, purge seqno.

A UPR consumer resumes with (vbucket uuid, seqno) and is told to roll back
when that pair may name a version the log no longer holds. ``LogHistory``
keeps what decides it; the log (``gateway.fronts.upr.vblog``) stores it in
its meta and does the I/O.

- A log closed cleanly continues its history (``restore``).
- A log that was not (a crash, a kill: records are served before their
  fsync) opens with a new failover entry at its proven end, as ep-engine
  3.0's warmup after an unclean shutdown (``src/warmup.cc``), so a consumer
  that saw more rolls back to it; the next seqno jumps past the reservation,
  so no seqno is used twice (``reconcile_unclean``).
- A log that cannot be proven starts over (``start_over``): one entry with
  a uuid it never had, at a bound above every seqno it may have handed out,
  and the vbucket due again from the TAP node (``refetch``).
- Before a seqno above ``reserved`` is published, the reservation moves
  ``RESERVE_STEP`` past it (``reservation_due``) and the log makes that
  durable first, so after losing its segments the reservation still bounds
  what was published.
"""

from __future__ import annotations

import random

from adapters.upr.failover_log import FailoverLog

RESERVE_STEP = 100_000


class LogHistory:
    __slots__ = ("_rng", "continued", "failover", "purge_seqno", "refetch", "reserved")

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.failover = FailoverLog(rng)
        self.reserved = 0
        """No seqno above this was handed out (durable before any is published)."""
        self.purge_seqno = 0
        self.refetch = False
        """The log was set aside: the vbucket's whole contents are due from the TAP node."""
        self.continued = True
        """Whether opening proved the history continues (no new failover entry)."""

    def begin(self) -> None:
        """A new vbucket: its first failover entry, at seqno 0."""
        self.failover.add(0)

    def restore(
        self,
        failover: list[tuple[int, int]],
        reserved: int,
        purge_seqno: int,
        refetch: bool,
    ) -> None:
        """What a proven log's meta recorded."""
        self.failover = FailoverLog(self._rng, failover)
        self.reserved = reserved
        self.purge_seqno = purge_seqno
        self.refetch = refetch

    def reconcile_unclean(self, high: int) -> tuple[int, int, int]:
        """The log was not closed cleanly, its records proven up to ``high``: a new
        failover entry at the proven end. Returns (its uuid, the proven seqno, the
        seqno new items follow: past every one reserved)."""
        proven = max(high, self.failover.entries[0][1] if len(self.failover) else 0)
        uuid = self.failover.add(proven)
        self.continued = False
        return uuid, proven, max(high, self.reserved)

    def start_over(self, bound: int, uuid: int) -> None:
        """The log could not be proven: a history of one entry, ``uuid`` (one it never
        had) at ``bound`` (above every seqno it may have handed out)."""
        self.failover = FailoverLog(self._rng, [(uuid, bound)])
        self.reserved = bound
        self.purge_seqno = 0
        self.refetch = True
        self.continued = False

    def reservation_due(self, upto: int, *, force: bool = False) -> int | None:
        """The reservation to make durable before ``upto`` is published (None: none due)."""
        if force or upto > self.reserved:
            return max(self.reserved, upto + RESERVE_STEP)
        return None
