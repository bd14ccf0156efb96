"""Pure reconciliation checks on small hand-made records."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from gateway.tools.capture import CaptureRecord, Kind, digest, item_record, marker_record
from gateway.tools.verify.checks import (
    Check,
    agreeing_latencies,
    final_state,
    latencies,
    reconcile_key,
)
from gateway.tools.verify.latency import SIZE, Histogram, bucket, bucket_bounds, bucket_value
from gateway.tools.verify.streams import check_stream

K = b"key"


def mut(
    rev: int,
    cas: int,
    value: bytes = b"v",
    *,
    seq: int | None = None,
    at: float = 0.0,
    flags: int = 0,
    exp: int = 0,
    snap: tuple[int, int] | None = None,
    ckpt: int | None = None,
    key: bytes = K,
) -> CaptureRecord:
    return item_record(
        3,
        key,
        "mutation",
        by_seqno=seq,
        rev_seqno=rev,
        cas=cas,
        flags=flags,
        expiration=exp,
        value=value,
        snapshot=snap,
        checkpoint_id=ckpt,
        arrival=at,
    )


def gone(
    kind: str,
    rev: int,
    cas: int,
    *,
    seq: int | None = None,
    at: float = 0.0,
    snap: tuple[int, int] | None = None,
    key: bytes = K,
) -> CaptureRecord:
    return item_record(
        3, key, kind, by_seqno=seq, rev_seqno=rev, cas=cas, snapshot=snap, arrival=at
    )


def checks(left: list[CaptureRecord], right: list[CaptureRecord]) -> list[Check]:
    outcome = reconcile_key(3, K, [left] if left else [], [right] if right else [])
    for m in outcome.mismatches:
        assert (m.vbucket, m.key) == (3, K)
    return sorted(m.check for m in outcome.mismatches)


def test_equal_histories_agree() -> None:
    left = [mut(1, 10, seq=1, at=1.0), mut(2, 11, b"w", seq=5, at=2.0)]
    right = [mut(1, 10, at=1.5), mut(2, 11, b"w", at=2.25)]  # TAP: no seqnos
    outcome = reconcile_key(3, K, [left], [right])
    assert outcome.mismatches == []
    assert sorted(outcome.latencies) == [0.25, 0.5]


def test_missing_and_extra() -> None:
    assert checks([mut(1, 10)], []) == [Check.MISSING]
    assert checks([], [gone("deletion", 2, 11)]) == [Check.EXTRA]
    assert checks([], []) == []


def test_dropped_last_mutation_shows_as_metadata_and_value() -> None:
    assert checks([mut(1, 10), mut(2, 11, b"new")], [mut(1, 10)]) == [Check.METADATA, Check.VALUE]


def test_changed_value_only() -> None:
    assert checks([mut(1, 10, b"a")], [mut(1, 10, b"b")]) == [Check.VALUE]


@pytest.mark.parametrize("field", ["flags", "exp", "cas"])
def test_changed_metadata(field: str) -> None:
    right = mut(
        1,
        99 if field == "cas" else 10,
        flags=5 if field == "flags" else 0,
        exp=7 if field == "exp" else 0,
    )
    outcome = reconcile_key(3, K, [[mut(1, 10)]], [[right]])
    (m,) = outcome.mismatches
    name = {"exp": "expiration"}.get(field, field)
    assert m.check == Check.METADATA and name in m.detail


def test_deleted_versus_live() -> None:
    assert checks([mut(1, 10), gone("deletion", 2, 11)], [mut(1, 10)]) == [Check.DELETED_VS_LIVE]


def test_deletion_versus_expiration() -> None:
    assert checks([gone("deletion", 2, 11)], [gone("expiration", 2, 11)]) == [Check.DELETE_KIND]
    # TAP cannot tell them apart: its DELETE agrees with either.
    assert checks([gone("delete", 2, 11)], [gone("expiration", 2, 11)]) == []
    assert checks([gone("deletion", 2, 11)], [gone("delete", 2, 11)]) == []
    assert checks([gone("deletion", 2, 11)], [gone("deletion", 3, 11)]) == [Check.METADATA]


def test_key_going_backwards_within_a_stream() -> None:
    swapped = [mut(2, 11, seq=6), mut(1, 10, seq=5)]
    outcome = reconcile_key(3, K, [[mut(1, 10, seq=5), mut(2, 11, seq=6)]], [swapped])
    got = [(m.check, m.side) for m in outcome.mismatches]
    assert got == [(Check.KEY_ORDER, "right"), (Check.KEY_ORDER, "right")]
    assert "rev_seqno went back from 2 to 1" in outcome.mismatches[0].detail
    # The newest version still decides the final state.
    assert outcome.right == outcome.left


def test_final_state_across_streams_is_the_newest_version() -> None:
    state = final_state([[mut(3, 12, b"c")], [mut(1, 10), mut(2, 11)]])
    assert state is not None and (state.rev_seqno, state.digest) == (3, digest(b"c"))
    assert final_state([]) is None


def test_latency_of_versions_seen_on_both_sides_only() -> None:
    assert latencies([[mut(1, 10, at=5.0), mut(1, 10, at=9.0)]], [[mut(1, 10, at=4.0)]]) == [-1.0]
    assert latencies([[mut(1, 10, at=5.0)]], [[mut(2, 11, at=6.0)]]) == []


# -- streams --------------------------------------------------------------------


def snap(start: int, end: int, at: float = 0.0) -> CaptureRecord:
    return marker_record(3, "snapshot", snapshot=(start, end), arrival=at)


def faults(protocol: str, records: list[CaptureRecord]) -> list[tuple[Check, bytes]]:
    return [(m.check, m.key) for m in check_stream("left", protocol, 3, records)]


def test_a_well_formed_upr_stream() -> None:
    records = [
        snap(1, 3),
        mut(1, 1, seq=1, snap=(1, 3), key=b"a"),
        mut(1, 2, seq=3, snap=(1, 3), key=b"b"),
        snap(4, 4),
        mut(2, 3, seq=4, snap=(4, 4), key=b"a"),
        marker_record(3, "stream_end", arrival=0),
    ]
    assert faults("upr", records) == []
    # Stopped mid-snapshot: not a fault.
    assert faults("upr", [*records[:4]]) == []


def test_upr_stream_faults() -> None:
    assert faults(
        "upr",
        [
            snap(1, 5),
            mut(1, 1, seq=3, snap=(1, 5), key=b"a"),
            mut(1, 2, seq=2, snap=(1, 5), key=b"b"),
        ],
    ) == [(Check.SEQNO_ORDER, b"b")]
    assert faults("upr", [mut(1, 1, seq=1, key=b"a")]) == [(Check.SNAPSHOT, b"a")]
    assert faults("upr", [snap(1, 2), mut(1, 1, seq=3, snap=(1, 2), key=b"x")]) == [
        (Check.SNAPSHOT, b"x")
    ]
    assert faults(
        "upr", [snap(1, 2), mut(1, 1, seq=1, snap=(1, 2)), mut(2, 2, seq=2, snap=(1, 2))]
    ) == [(Check.SNAPSHOT, K)]
    # A snapshot cut short by the next marker, and a marker range going backwards.
    short = faults("upr", [snap(1, 3), mut(1, 1, seq=1, snap=(1, 3)), snap(2, 4)])
    assert short == [(Check.SNAPSHOT, b""), (Check.SNAPSHOT, b"")]
    assert faults("upr", [snap(1, 2), mut(1, 1, seq=2, snap=(5, 6))]) == [(Check.SNAPSHOT, K)]


def test_draft_snapshots() -> None:
    start = marker_record(3, "snapshot_start", arrival=0)
    end = marker_record(3, "snapshot_end", arrival=0)
    assert faults("upr", [start, mut(1, 1, seq=1), end, start, mut(2, 2, seq=2), end]) == []
    assert faults("upr", [start, mut(1, 1, seq=1), mut(2, 2, seq=2)]) == [(Check.SNAPSHOT, K)]
    assert faults("upr", [end]) == [(Check.SNAPSHOT, b"")]


def test_tap_checkpoints() -> None:
    def cs(i: int) -> CaptureRecord:
        return marker_record(3, "checkpoint_start", checkpoint_id=i, arrival=0)

    def ce(i: int) -> CaptureRecord:
        return marker_record(3, "checkpoint_end", checkpoint_id=i, arrival=0)

    backfill_end = marker_record(3, "backfill_end", arrival=0)
    good = [mut(1, 1, key=b"a"), backfill_end, cs(2), mut(2, 2, ckpt=2), ce(2), cs(3)]
    assert faults("tap", good) == []
    assert faults("tap", [backfill_end, mut(1, 1, key=b"z")]) == [(Check.CHECKPOINT, b"z")]
    assert faults("tap", [cs(2), cs(3)]) == [(Check.CHECKPOINT, b"")]
    assert faults("tap", [cs(3), ce(3), cs(2)]) == [(Check.CHECKPOINT, b"")]
    assert faults("tap", [cs(3), ce(4)]) == [(Check.CHECKPOINT, b"")]
    assert faults("tap", [ce(4)]) == [(Check.CHECKPOINT, b"")]
    assert faults("tap", [cs(3), mut(1, 1, ckpt=4)]) == [(Check.CHECKPOINT, K)]
    # A restarted backfill starts seqnos and checkpoints over.
    restart = [cs(5), ce(5), marker_record(3, "backfill_start", arrival=0), cs(1)]
    assert faults("tap", restart) == []


# -- latency histogram ------------------------------------------------------------


@given(st.lists(st.floats(-500, 500, allow_nan=False), min_size=1, max_size=200))
def test_histogram_quantiles_are_close(values: list[float]) -> None:
    hist = Histogram()
    hist.add_all(values)
    assert sum(hist.counts) == hist.count == len(values)
    ordered = sorted(values)
    exact = ordered[int(0.5 * (len(values) - 1))]
    got = hist.quantile(0.5)
    assert got is not None
    assert abs(got - exact) <= max(1e-6, abs(exact) * 0.13)


def test_histogram_buckets_and_merge() -> None:
    assert bucket(0.0) == bucket(1e-7) == SIZE // 2
    assert bucket(1e9) == SIZE - 1 and bucket(-1e9) == 0
    assert bucket_value(bucket(0.01)) == pytest.approx(0.01, rel=0.13)
    one, two = Histogram(), Histogram()
    one.add_all([0.1, 0.2])
    two.add_all([-0.3])
    one.merge(two.counts, two.count, two.total, two.low, two.high)
    assert one.summary()["count"] == 3 and one.low == -0.3 and one.high == 0.2
    assert Histogram().summary() == {"count": 0} and Histogram().quantile(0.5) is None


@given(st.lists(st.floats(-999, 999, allow_nan=False), min_size=1, max_size=100))
def test_histogram_buckets_hold_their_values(values: list[float]) -> None:
    """Each non-empty bucket's bounds contain the values put in it (the HTML report's bars)."""
    hist = Histogram()
    hist.add_all(values)
    buckets = hist.buckets()
    assert sum(n for _, _, n in buckets) == len(values)
    assert [low for low, _, _ in buckets] == sorted(low for low, _, _ in buckets)
    for x in values:
        low, high = bucket_bounds(bucket(x))
        slack = 1e-9 * max(abs(low), abs(high))  # float rounding at a bucket's edge
        assert low - slack <= x <= high + slack


# -- the cut of a two-sided capture (gateway.tools.capture.cut) ----------------------------


def test_changes_past_the_cut_are_in_flight_not_mismatches() -> None:
    base = [mut(1, 10), mut(2, 20, b"w")]
    # Left recorded a change past the cut (CAS 25) that right never reached.
    outcome = reconcile_key(3, K, [[*base, mut(3, 30, b"x")]], [base], cut=25)
    assert outcome.mismatches == [] and Check.VALUE in {m.check for m in outcome.in_flight}
    # Right's version inside the cut was superseded past it (deduplicated on its path).
    outcome = reconcile_key(3, K, [base], [[base[0], mut(3, 30, b"x")]], cut=25)
    assert outcome.mismatches == [] and outcome.in_flight
    # A key only one side has, created past the cut: in flight.
    outcome = reconcile_key(3, K, [[mut(1, 30)]], [], cut=25)
    assert outcome.mismatches == [] and [m.check for m in outcome.in_flight] == [Check.MISSING]


def test_a_change_inside_the_cut_that_one_side_lacks_is_a_mismatch() -> None:
    base = [mut(1, 10), mut(2, 20, b"w")]
    outcome = reconcile_key(3, K, [base], [base[:1]], cut=25)
    assert outcome.in_flight == [] and Check.VALUE in {m.check for m in outcome.mismatches}
    outcome = reconcile_key(3, K, [[*base, gone("deletion", 3, 22)]], [base], cut=25)
    assert [m.check for m in outcome.mismatches] == [Check.DELETED_VS_LIVE]


def test_a_tap_delete_of_a_version_without_expiration_is_a_deletion() -> None:
    """TAP cannot tell; the removed version in the same stream can (no TTL: no expiry)."""
    tap = [[mut(1, 10), gone("delete", 2, 20)]]
    assert final_state(tap).kind == int(Kind.DELETION)  # type: ignore[union-attr]
    bad = reconcile_key(3, K, tap, [[mut(1, 10), gone("expiration", 2, 20)]])
    assert [m.check for m in bad.mismatches] == [Check.DELETE_KIND]
    ttl = [[mut(1, 10, exp=5), gone("delete", 2, 20)]]
    assert final_state(ttl).kind == int(Kind.DELETE)  # type: ignore[union-attr]
    gap = [[mut(1, 10), gone("delete", 3, 20)]]  # a version in between was not seen
    assert final_state(gap).kind == int(Kind.DELETE)  # type: ignore[union-attr]


@given(
    shared=st.integers(0, 6),
    left_past=st.integers(0, 4),
    right_past=st.integers(0, 4),
    values=st.lists(st.binary(max_size=2), min_size=15, max_size=15),
)
def test_records_past_the_cut_never_make_a_mismatch(
    shared: int, left_past: int, right_past: int, values: list[bytes]
) -> None:
    """Two sides that agree up to the cut agree whatever each recorded past it."""
    cut = 10 * shared + 5
    history = [mut(i + 1, 10 * (i + 1), values[i]) for i in range(shared)]
    past = [mut(shared + i + 1, cut + 10 * (i + 1), values[shared + i]) for i in range(4)]
    outcome = reconcile_key(3, K, [history + past[:left_past]], [history + past[:right_past]], cut)
    assert outcome.mismatches == []
    assert bool(outcome.in_flight) == (left_past != right_past)


_KINDS = ("mutation",) * 5 + ("deletion", "expiration", "delete")
_FIELDS = ("kind", "rev_seqno", "cas", "flags", "expiration", "digest")


def _seqnos(draw: st.DrawFn, n: int) -> list[int | None]:
    """Mostly growing seqnos, sometimes missing (TAP) or going back."""
    if not draw(st.integers(0, 3)):
        return [None] * n
    low = draw(st.sampled_from([-1, 0, 0, 0]))
    steps = draw(st.lists(st.integers(low, 2), min_size=n, max_size=n))
    return [max(0, 3 + sum(steps[: i + 1])) for i in range(n)]


@st.composite
def _key_histories(draw: st.DrawFn) -> tuple[list[list[CaptureRecord]], list[list[CaptureRecord]]]:
    """One key on both sides: the same versions, often, or nearly (one field changed)."""
    n = draw(st.integers(1, 4))
    base = draw(st.sampled_from([0, 2**64 - 4]))
    revs = [
        base + sum(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))[: i + 1])
        for i in range(n)
    ]
    if draw(st.integers(0, 3)):
        revs = [base + i + 1 for i in range(n)]
    cases = sorted(draw(st.lists(st.sampled_from([1, 2, 3, 2**63 + 1]), min_size=n, max_size=n)))
    left = []
    for i, seq in enumerate(_seqnos(draw, n)):
        kind = draw(st.sampled_from(_KINDS))
        if kind == "mutation":
            r = mut(
                0,
                cases[i],
                draw(st.sampled_from([b"a", b"b"])),
                seq=seq,
                at=float(i),
                flags=draw(st.integers(0, 1)),
                exp=draw(st.integers(0, 1)),
            )
        else:
            r = gone(kind, 0, cases[i], seq=seq, at=float(i))
        left.append(r._replace(rev_seqno=revs[i]))
    right = [
        r._replace(by_seqno=s, arrival=r.arrival + 0.5)
        for r, s in zip(left, _seqnos(draw, n), strict=True)
    ]
    change = draw(st.sampled_from(["none"] * 3 + ["field"] * 4 + ["drop", "streams", "swap"]))
    if change == "field":
        i, name = draw(st.sampled_from([n - 1, n - 1, 0])), draw(st.sampled_from(_FIELDS))
        new = {"kind": 2, "rev_seqno": None, "cas": 2, "flags": 7, "expiration": 7, "digest": None}
        right[i] = right[i]._replace(**{name: new[name]})
    elif change == "drop":
        del right[draw(st.integers(0, n - 1))]
    elif change == "swap" and n > 1:
        right[0], right[1] = right[1], right[0]
    lefts = [left]
    rights = [right] if right else []
    if change == "streams" and n > 1:
        rights = [right[:1], right[1:]]
    return lefts, rights


@settings(max_examples=400)
@given(histories=_key_histories(), cut=st.one_of(st.none(), st.sampled_from([0, 2, 3, 2**63 + 1])))
def test_the_shortcut_for_agreeing_keys_matches_reconcile_key(
    histories: tuple[list[list[CaptureRecord]], list[list[CaptureRecord]]], cut: int | None
) -> None:
    """Wherever agreeing_latencies answers, reconcile_key finds nothing and the same latencies."""
    left, right = histories
    agreed = agreeing_latencies(left, right, cut)
    outcome = reconcile_key(3, K, left, right, cut)
    if agreed is not None:
        assert outcome.mismatches == [] and outcome.in_flight == []
        assert sorted(agreed) == sorted(outcome.latencies)


@pytest.mark.parametrize("field", (*_FIELDS, "by_seqno"))
def test_the_shortcut_declines_a_changed_final_version(field: str) -> None:
    left = [mut(1, 10, seq=1), mut(2, 11, b"w", seq=2, flags=1, exp=1)]
    new = {"kind": 2, "rev_seqno": 1, "cas": 12, "flags": 0, "expiration": 0, "digest": None}
    new["by_seqno"] = 0  # going back within the stream: key_order
    right = [left[0], left[1]._replace(**{field: new[field]})]
    assert agreeing_latencies([left], [right]) is None
    assert reconcile_key(3, K, [left], [right]).mismatches
    assert agreeing_latencies([left], [left]) == [0.0, 0.0]
