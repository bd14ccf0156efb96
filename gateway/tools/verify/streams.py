"""Per-stream checks: one connection's records of one vbucket, in arrival order.

Theory of operation. ``check_stream`` walks the records once with a small
state: the last by_seqno (must strictly grow: ``seqno_order``); for UPR the
open snapshot (released: the marker's range, draft: SNAPSHOT_START..END),
the keys seen in it and the last seqno in it (``snapshot``: items outside
the marker before them, a key twice in one snapshot, a snapshot left before
its end seqno, marker ranges going backwards); for TAP the open checkpoint
and the backfill phase (``checkpoint``: START while one is open, END not
matching START, ids not growing, a live item outside any checkpoint, an
item recorded with another checkpoint id than the open one).

A stream that stops mid-snapshot (a capture stopped, a connection lost) is
not a fault: only a snapshot followed by another marker or a stream end is
held to its end seqno.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.tools.capture.records import CaptureRecord, Kind
from gateway.tools.verify.checks import Check, Mismatch

_SNAPSHOT = int(Kind.SNAPSHOT)
_SNAPSHOT_START = int(Kind.SNAPSHOT_START)
_SNAPSHOT_END = int(Kind.SNAPSHOT_END)
_CHECKPOINT_START = int(Kind.CHECKPOINT_START)
_CHECKPOINT_END = int(Kind.CHECKPOINT_END)
_BACKFILL_START = int(Kind.BACKFILL_START)
_BACKFILL_END = int(Kind.BACKFILL_END)
_STREAM_END = int(Kind.STREAM_END)


class _Walk:
    __slots__ = (
        "checkpoint",
        "last_checkpoint",
        "last_seqno",
        "live",
        "out",
        "side",
        "snap",
        "snap_keys",
        "snap_last",
        "upr",
        "vbucket",
    )

    def __init__(self, side: str, protocol: str, vbucket: int) -> None:
        self.side = side
        self.vbucket = vbucket
        self.upr = protocol == "upr"
        self.out: list[Mismatch] = []
        self.last_seqno: int | None = None
        self.snap: tuple[int | None, int | None] | None = None
        self.snap_keys: set[bytes] = set()
        self.snap_last: int | None = None
        self.checkpoint: int | None = None
        self.last_checkpoint: int | None = None
        self.live = False

    def fault(self, check: Check, key: bytes, detail: str) -> None:
        self.out.append(Mismatch(check, self.vbucket, key, self.side, detail))

    def close_snapshot(self, why: str) -> None:
        snap = self.snap
        if snap is not None and snap[1] is not None and self.snap_last != snap[1]:
            self.fault(
                Check.SNAPSHOT,
                b"",
                f"snapshot {snap[0]}..{snap[1]} ended by {why} at seqno {self.snap_last}",
            )
        self.snap = None
        self.snap_keys = set()
        self.snap_last = None

    def marker(self, r: CaptureRecord) -> None:
        kind = r.kind
        if kind == _SNAPSHOT:
            previous_end = self.snap[1] if self.snap is not None else self.last_seqno
            self.close_snapshot("the next marker")
            start, end = r.snap_start, r.snap_end
            if start is None or end is None or start > end:
                self.fault(Check.SNAPSHOT, b"", f"snapshot marker with range {start}..{end}")
            elif previous_end is not None and start <= previous_end:
                self.fault(
                    Check.SNAPSHOT,
                    b"",
                    f"snapshot {start}..{end} starts at or before seqno {previous_end}",
                )
            self.snap = (start, end)
        elif kind == _SNAPSHOT_START:
            if self.snap is not None:
                self.fault(Check.SNAPSHOT, b"", "SNAPSHOT_START inside an open snapshot")
            self.snap, self.snap_keys, self.snap_last = (None, None), set(), None
        elif kind == _SNAPSHOT_END:
            if self.snap is None:
                self.fault(Check.SNAPSHOT, b"", "SNAPSHOT_END without SNAPSHOT_START")
            self.snap, self.snap_keys, self.snap_last = None, set(), None
        elif kind == _STREAM_END:
            self.close_snapshot("STREAM_END")
        elif kind == _CHECKPOINT_START:
            self.checkpoint_start(r.checkpoint_id)
        elif kind == _CHECKPOINT_END:
            if self.checkpoint is None:
                self.fault(
                    Check.CHECKPOINT, b"", f"CHECKPOINT_END {r.checkpoint_id} with none open"
                )
            elif r.checkpoint_id != self.checkpoint:
                self.fault(
                    Check.CHECKPOINT,
                    b"",
                    f"CHECKPOINT_END {r.checkpoint_id} closes checkpoint {self.checkpoint}",
                )
            self.checkpoint = None
        elif kind == _BACKFILL_START:
            # The producer restarts the vbucket (e.g. it went back): seqnos start over.
            self.live, self.checkpoint, self.last_checkpoint, self.last_seqno = (
                False,
                None,
                None,
                None,
            )
        elif kind == _BACKFILL_END:
            self.live = True

    def checkpoint_start(self, ident: int | None) -> None:
        if self.checkpoint is not None:
            self.fault(
                Check.CHECKPOINT,
                b"",
                f"CHECKPOINT_START {ident} while checkpoint {self.checkpoint} is open",
            )
        if ident is not None and self.last_checkpoint is not None and ident <= self.last_checkpoint:
            self.fault(
                Check.CHECKPOINT,
                b"",
                f"checkpoint id went from {self.last_checkpoint} to {ident}",
            )
        self.checkpoint = ident
        self.last_checkpoint = ident if ident is not None else self.last_checkpoint
        self.live = True

    def item(self, r: CaptureRecord) -> None:
        seqno = r.by_seqno
        if seqno is not None:
            if self.last_seqno is not None and seqno <= self.last_seqno:
                self.fault(
                    Check.SEQNO_ORDER,
                    r.key,
                    f"by_seqno {seqno} after {self.last_seqno} in the vbucket's stream",
                )
            self.last_seqno = seqno if self.last_seqno is None else max(self.last_seqno, seqno)
        if self.upr:
            self.upr_item(r)
        else:
            self.tap_item(r)

    def upr_item(self, r: CaptureRecord) -> None:
        snap = self.snap
        if snap is None:
            self.fault(Check.SNAPSHOT, r.key, f"item seqno {r.by_seqno} outside any snapshot")
            return
        start, end = snap
        seqno = r.by_seqno
        if start is not None and end is not None and seqno is not None:
            if not start <= seqno <= end:
                self.fault(
                    Check.SNAPSHOT, r.key, f"item seqno {seqno} outside snapshot {start}..{end}"
                )
            if (r.snap_start, r.snap_end) != (start, end):
                self.fault(
                    Check.SNAPSHOT,
                    r.key,
                    f"item recorded in snapshot {r.snap_start}..{r.snap_end}, "
                    f"the open one is {start}..{end}",
                )
        if r.key in self.snap_keys:
            self.fault(Check.SNAPSHOT, r.key, "key twice in one snapshot")
        self.snap_keys.add(r.key)
        self.snap_last = seqno

    def tap_item(self, r: CaptureRecord) -> None:
        if self.checkpoint is not None:
            if r.checkpoint_id != self.checkpoint:
                self.fault(
                    Check.CHECKPOINT,
                    r.key,
                    f"item recorded in checkpoint {r.checkpoint_id}, "
                    f"the open one is {self.checkpoint}",
                )
        elif self.live:
            self.fault(Check.CHECKPOINT, r.key, "live item outside any checkpoint")


def check_stream(
    side: str, protocol: str, vbucket: int, records: Iterable[CaptureRecord]
) -> list[Mismatch]:
    """Faults of one stream of one vbucket (records in arrival order)."""
    walk = _Walk(side, protocol, vbucket)
    for r in records:
        if r.kind < 10:
            walk.item(r)
        else:
            walk.marker(r)
    return walk.out
