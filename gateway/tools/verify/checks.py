"""Reconciliation checks: pure functions over capture records, no Spark.

Two views of the same bucket (LEFT and RIGHT, e.g. a TAP capture and a UPR
capture) agree when, for every vbucket and key:

- both saw the key (``missing`` on the right / ``extra`` on the right
  otherwise);
- the final state is the same: live on both with the same value digest
  (``value``) and CAS, rev_seqno, flags and expiration (``metadata``), or
  deleted on both (``deleted_vs_live`` otherwise) with the same CAS and
  rev_seqno; a deletion on one side and an expiration on the other is
  ``delete_kind`` (a delete whose cause the protocol does not tell, TAP's,
  agrees with either);
- within each stream of a side, the key's rev_seqno and by_seqno never go
  backwards (``key_order``).

A TAP delete does not say whether it was a deletion or an expiration; when
the stream also carried the version it removed (rev_seqno one below) and
that version had no expiration, it can only have been a deletion, and is
compared as one.

Captures of a live bucket made by a two-sided capture carry a cut per
vbucket (a CAS, ``gateway.tools.capture.cut``): each side's final state is then
its newest version at or below the cut, and a difference that comes only
from changes past the cut (one side recorded them before it stopped, the
other did not, or a side's version inside the cut was superseded past it)
is "in flight": reported, never a mismatch.

Each stream (one connection, direction and vbucket, in arrival order) must
also be well formed on its own: by_seqnos strictly grow (``seqno_order``);
UPR items sit inside the snapshot marker before them, a snapshot holds a key
at most once and ends at its end seqno (``snapshot``); TAP checkpoints open
and close in pairs with growing ids and live items sit inside one
(``checkpoint``).

The final state of a key on a side is its newest version: the highest
rev_seqno (then CAS, then arrival), which every protocol carries, so a side
made of several connections still has one answer. Latency is measured per
version seen on both sides (same key, rev_seqno and CAS): right arrival minus
left arrival, each side's first sighting.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.tools.capture.records import CaptureRecord, Kind

MUTATION = int(Kind.MUTATION)
DELETION = int(Kind.DELETION)
EXPIRATION = int(Kind.EXPIRATION)
DELETE = int(Kind.DELETE)
SIDES = ("left", "right")


class Check(enum.StrEnum):
    MISSING = "missing"
    EXTRA = "extra"
    DELETED_VS_LIVE = "deleted_vs_live"
    VALUE = "value"
    METADATA = "metadata"
    DELETE_KIND = "delete_kind"
    KEY_ORDER = "key_order"
    SEQNO_ORDER = "seqno_order"
    SNAPSHOT = "snapshot"
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True, slots=True)
class FinalState:
    """A key's newest version on one side."""

    kind: int
    by_seqno: int | None
    rev_seqno: int | None
    cas: int
    flags: int
    expiration: int
    digest: bytes | None

    @property
    def deleted(self) -> bool:
        return self.kind != MUTATION

    @classmethod
    def of(cls, r: CaptureRecord) -> FinalState:
        return cls(r.kind, r.by_seqno, r.rev_seqno, r.cas, r.flags, r.expiration, r.digest)

    def describe(self) -> str:
        if self.deleted:
            return f"{Kind(self.kind).label} rev {self.rev_seqno} cas {self.cas}"
        return (
            f"live rev {self.rev_seqno} cas {self.cas} flags 0x{self.flags:x} "
            f"exp {self.expiration} value {self.digest.hex() if self.digest else '-'}"
        )


@dataclass(frozen=True, slots=True)
class Mismatch:
    check: Check
    vbucket: int
    key: bytes
    side: str
    """``left``, ``right`` or ``both``: where the fault shows."""
    detail: str
    left: FinalState | None = None
    right: FinalState | None = None


@dataclass(slots=True)
class KeyOutcome:
    left: FinalState | None
    right: FinalState | None
    mismatches: list[Mismatch] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    in_flight: list[Mismatch] = field(default_factory=list)
    """Differences that come only from changes past the cut."""


Streams = Sequence[Sequence[CaptureRecord]]
"""A side's item records of one key: one list per stream, each in arrival order."""


def _newest(r: CaptureRecord) -> tuple[int, int, float]:
    return (-1 if r.rev_seqno is None else r.rev_seqno, r.cas, r.arrival)


def _delete_kind(records: Sequence[CaptureRecord], index: int) -> int:
    """A TAP delete whose removed version was in the stream without an expiration: DELETION."""
    r = records[index]
    if r.kind != DELETE or r.rev_seqno is None or index == 0:
        return r.kind
    before = records[index - 1]
    if before.kind == MUTATION and before.rev_seqno == r.rev_seqno - 1 and not before.expiration:
        return DELETION
    return r.kind


def final_state(streams: Streams, cut: int | None = None) -> FinalState | None:
    """The newest version (at or below the ``cut`` CAS when one is given)."""
    best: CaptureRecord | None = None
    kind = 0
    for records in streams:
        for i, r in enumerate(records):
            if cut is not None and r.cas > cut:
                continue
            if best is None or _newest(r) >= _newest(best):
                best, kind = r, _delete_kind(records, i)
    if best is None:
        return None
    return FinalState(
        kind, best.by_seqno, best.rev_seqno, best.cas, best.flags, best.expiration, best.digest
    )


def _past(streams: Streams, cut: int) -> bool:
    return any(r.cas > cut for records in streams for r in records)


def _order(state: FinalState | None) -> tuple[int, int]:
    if state is None:
        return (-2, -1)
    return (-1 if state.rev_seqno is None else state.rev_seqno, state.cas)


def key_order(vbucket: int, key: bytes, side: str, streams: Streams) -> list[Mismatch]:
    """rev_seqno or by_seqno of a key going backwards within one stream."""
    out: list[Mismatch] = []
    for records in streams:
        last_rev = last_seqno = None
        for r in records:
            if r.rev_seqno is not None:
                if last_rev is not None and r.rev_seqno < last_rev:
                    out.append(
                        Mismatch(
                            Check.KEY_ORDER,
                            vbucket,
                            key,
                            side,
                            f"rev_seqno went back from {last_rev} to {r.rev_seqno}",
                        )
                    )
                last_rev = r.rev_seqno if last_rev is None else max(last_rev, r.rev_seqno)
            if r.by_seqno is not None:
                if last_seqno is not None and r.by_seqno < last_seqno:
                    out.append(
                        Mismatch(
                            Check.KEY_ORDER,
                            vbucket,
                            key,
                            side,
                            f"by_seqno went back from {last_seqno} to {r.by_seqno}",
                        )
                    )
                last_seqno = r.by_seqno if last_seqno is None else max(last_seqno, r.by_seqno)
    return out


def compare_final(
    vbucket: int, key: bytes, left: FinalState | None, right: FinalState | None
) -> list[Mismatch]:
    def make(check: Check, side: str, detail: str) -> Mismatch:
        return Mismatch(check, vbucket, key, side, detail, left, right)

    if left is None and right is None:
        return []
    if right is None:
        assert left is not None
        return [make(Check.MISSING, "right", f"never seen on the right; left: {left.describe()}")]
    if left is None:
        return [make(Check.EXTRA, "right", f"never seen on the left; right: {right.describe()}")]
    if left == right:
        return []
    if left.deleted != right.deleted:
        return [
            make(
                Check.DELETED_VS_LIVE,
                "both",
                f"left: {left.describe()}; right: {right.describe()}",
            )
        ]
    out: list[Mismatch] = []
    if left.deleted:
        kinds = {left.kind, right.kind}
        if kinds == {DELETION, EXPIRATION}:
            out.append(
                make(
                    Check.DELETE_KIND,
                    "both",
                    f"left: {Kind(left.kind).label}, right: {Kind(right.kind).label}",
                )
            )
        fields: tuple[str, ...] = ("rev_seqno", "cas")
    else:
        if left.digest != right.digest:
            out.append(
                make(
                    Check.VALUE,
                    "both",
                    f"value digest left {_hex(left.digest)} right {_hex(right.digest)}",
                )
            )
        fields = ("rev_seqno", "cas", "flags", "expiration")
    differ = [
        f"{name} {getattr(left, name)} vs {getattr(right, name)}"
        for name in fields
        if getattr(left, name) != getattr(right, name)
        and not (name == "rev_seqno" and None in (left.rev_seqno, right.rev_seqno))
    ]
    if differ:
        out.append(make(Check.METADATA, "both", "; ".join(differ)))
    return out


def _hex(digest: bytes | None) -> str:
    return digest.hex() if digest else "-"


def _first_sightings(streams: Streams) -> dict[tuple[int | None, int], float]:
    seen: dict[tuple[int | None, int], float] = {}
    for records in streams:
        for r in records:
            version = (r.rev_seqno, r.cas)
            if version not in seen or r.arrival < seen[version]:
                seen[version] = r.arrival
    return seen


def latencies(left: Streams, right: Streams) -> list[float]:
    """Right minus left arrival of each version seen on both sides."""
    lefts = _first_sightings(left)
    out = []
    for version, arrival in _first_sightings(right).items():
        start = lefts.get(version)
        if start is not None:
            out.append(arrival - start)
    return out


def agreeing_latencies(left: Streams, right: Streams, cut: int | None = None) -> list[float] | None:
    """The latencies of a key that ``reconcile_key`` would pass, or ``None`` to ask it.

    A shortcut for the common key, with no per-key objects: each side saw it on one
    stream, the same versions in the same order (``by_seqno`` aside, which no check
    compares across sides), rev_seqnos strictly growing and by_seqnos never going
    back, no delete of unknown cause, nothing past the cut. Then both final states
    are the last version, equal, in order, and each version is one latency.
    """
    if len(left) != 1 or len(right) != 1:
        return None
    lefts, rights = left[0], right[0]
    if len(lefts) != len(rights):
        return None
    out = []
    last_rev = -1
    seqnos = [-1, -1]
    for a, b in zip(lefts, rights, strict=True):
        rev = a.rev_seqno
        if (
            a.kind == DELETE
            or rev is None
            or rev <= last_rev
            or (a.kind, rev, a.cas, a.flags, a.expiration, a.digest)
            != (b.kind, b.rev_seqno, b.cas, b.flags, b.expiration, b.digest)
            or (cut is not None and a.cas > cut)
        ):
            return None
        for i, seqno in enumerate((a.by_seqno, b.by_seqno)):
            if seqno is not None:
                if seqno < seqnos[i]:
                    return None
                seqnos[i] = seqno
        last_rev = rev
        out.append(b.arrival - a.arrival)
    return out


def reconcile_key(
    vbucket: int, key: bytes, left: Streams, right: Streams, cut: int | None = None
) -> KeyOutcome:
    """Every per-key check of one vbucket and key (up to the ``cut`` CAS when given)."""
    left_final, right_final = final_state(left), final_state(right)
    outcome = KeyOutcome(left_final, right_final)
    if cut is None:
        outcome.mismatches = compare_final(vbucket, key, left_final, right_final)
    else:
        left_cut, right_cut = final_state(left, cut), final_state(right, cut)
        inside = compare_final(vbucket, key, left_cut, right_cut)
        # The side with the older state inside the cut superseded it past the cut.
        older = left if _order(left_cut) < _order(right_cut) else right
        if inside and _past(older, cut):
            outcome.in_flight = inside
        elif inside:
            outcome.mismatches = inside
        else:
            outcome.in_flight = compare_final(vbucket, key, left_final, right_final)
    outcome.mismatches += key_order(vbucket, key, "left", left)
    outcome.mismatches += key_order(vbucket, key, "right", right)
    outcome.latencies = latencies(left, right)
    return outcome
