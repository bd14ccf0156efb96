"""The vectorised vbucket checks give what the per-record checks give, on generated vbuckets."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("numpy", reason="needs the pipeline extra")
pa = pytest.importorskip("pyarrow", reason="needs the pipeline extra")

import hypothesis.strategies as st
from hypothesis import given, settings

from gateway.tools.capture import CaptureRecord, Kind, digest
from gateway.tools.capture.records import cut_record
from gateway.tools.verify.partition import RECORD_COLUMNS, reconcile_columns, reconcile_rows
from gateway.tools.verify.synthetic import vbucket_history

_U64 = {"by_seqno", "rev_seqno", "cas", "checkpoint_id", "snap_start", "snap_end"}
_TYPES = {"kind": pa.int32(), "vbucket": pa.int32(), "key": pa.binary(), "digest": pa.binary()}
_TYPES["arrival"] = pa.float64()


def _signed(value: int | None) -> int | None:
    return None if value is None else value - (1 << 64) if value >= 1 << 63 else value


def batches(rows: list[tuple[str, str, str, int, CaptureRecord]], size: int) -> list[Any]:
    """The job's input: rows sorted by vbucket, side, stream, segment, index."""
    rows = sorted(rows, key=lambda x: (x[4].vbucket, x[0], x[2], x[3]))
    columns: dict[str, Any] = {
        "side": pa.array([x[0] for x in rows], pa.string()),
        "protocol": pa.array([x[1] for x in rows], pa.string()),
        "stream": pa.array([x[2] for x in rows], pa.string()),
    }
    for i, name in enumerate(RECORD_COLUMNS):
        values = [x[4][i] for x in rows]
        if name in _U64:
            values = [_signed(v) for v in values]
        columns[name] = pa.array(values, _TYPES.get(name, pa.int64()))
    columns["segment"] = pa.array([0] * len(rows), pa.int32())
    columns["idx"] = pa.array([x[3] for x in rows], pa.int64())
    return pa.Table.from_pydict(columns).to_batches(max_chunksize=size)


def results(run: Any, data: list[Any]) -> list[dict[str, Any]]:
    out = [row for batch in run(iter(data)) for row in batch.to_pylist()]
    for row in out:
        if row["row_type"] == "stats":
            total = row.pop("lat_sum")
            row["lat_sum"] = None if total is None else round(total, 6)
    return sorted(out, key=repr)


def _mutate(records: list[CaptureRecord], op: str, at: int) -> list[CaptureRecord]:
    if not records:
        return records
    i = at % len(records)
    r = records[i]
    if op == "drop":
        return records[:i] + records[i + 1 :]
    if op == "value" and r.kind < 10:
        return [*records[:i], r._replace(digest=digest(b"other")), *records[i + 1 :]]
    if op == "expire" and r.kind in (Kind.DELETION, Kind.MUTATION):
        return [*records[:i], r._replace(kind=int(Kind.EXPIRATION)), *records[i + 1 :]]
    if op == "swap" and i + 1 < len(records):
        return [*records[:i], records[i + 1], r, *records[i + 2 :]]
    if op == "twice":
        return [*records[: i + 1], r, *records[i + 1 :]]
    if op == "range" and r.kind < 10 and r.snap_end is not None:
        return [*records[:i], r._replace(snap_end=r.snap_end + 1), *records[i + 1 :]]
    if op == "rekey" and r.kind < 10 and i and records[i - 1].kind < 10:
        return [*records[:i], r._replace(key=records[i - 1].key), *records[i + 1 :]]
    if op in ("rev0", "seq0") and r.kind < 10:
        changed = r._replace(rev_seqno=0) if op == "rev0" else r._replace(by_seqno=0)
        return [*records[:i], changed, *records[i + 1 :]]
    if op == "delete" and r.kind < 10:
        return [*records[:i], r._replace(kind=int(Kind.DELETE), digest=None), *records[i + 1 :]]
    return records


@st.composite
def vbuckets(draw: st.DrawFn) -> list[tuple[str, str, str, int, CaptureRecord]]:
    rows: list[tuple[str, str, str, int, CaptureRecord]] = []
    for vb in range(draw(st.integers(1, 2))):
        options = {
            "seed": draw(st.integers(0, 3)),
            "snapshot_items": draw(st.integers(1, 4)),
            "rewrite": 0.4,
        }
        keys = draw(st.integers(0, 6))
        left = vbucket_history(vb, keys, **options)  # type: ignore[arg-type]
        right = vbucket_history(vb, keys, delay=0.25, **options)  # type: ignore[arg-type]
        for op, at in draw(
            st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 99)), max_size=3)
        ):
            right = _mutate(right, op, at)
        split = draw(st.integers(0, len(left)))
        streams = [("left", "upr", "a", left[:split]), ("left", "upr", "b", left[split:])]
        protocol = draw(st.sampled_from(["upr", "upr", "tap"]))
        streams.append(("right", protocol, "c", right))
        if draw(st.booleans()):  # a cut inside the history on both sides
            cas = 1_000_000 * (vb + 1) + draw(st.integers(0, 2 * keys + 2))
            for side in ("left", "right"):
                streams.append((side, "upr", "cut", [cut_record(vb, cas=cas, seqno=0, arrival=0)]))
        for side, proto, name, records in streams:
            rows += [(side, proto, name, i, r) for i, r in enumerate(records)]
    return rows


OPS = ("drop", "value", "expire", "swap", "twice", "range", "delete", "rekey", "rev0", "seq0")


@settings(max_examples=300, deadline=None)
@given(rows=vbuckets(), size=st.sampled_from([3, 1000]))
def test_the_columns_find_what_the_records_find(rows: list[Any], size: int) -> None:
    data = batches(rows, size)
    assert results(reconcile_columns, data) == results(reconcile_rows, data)


def test_a_damaged_segment_row_passes_through() -> None:
    bad = CaptureRecord(101, -1, b"f: bad", None, None, 0, 0, 0, None, None, None, None, 0, 0.0)
    rows = [("left", "", "f", 0, bad)]
    rows += [("left", "upr", "a", i, r) for i, r in enumerate(vbucket_history(0, 3))]
    rows += [("right", "upr", "b", i, r) for i, r in enumerate(vbucket_history(0, 3))]
    data = batches(rows, 4)
    got = results(reconcile_columns, data)
    assert got == results(reconcile_rows, data)
    assert [r["check"] for r in got if r["row_type"] == "diagnostic"] == ["damaged"]


@pytest.mark.parametrize("op", OPS)
def test_every_single_change_on_one_or_both_sides(op: str) -> None:
    """Each change at each position of a small vbucket, as a defect and as a stream fault."""
    options = {"snapshot_items": 2, "rewrite": 1.0, "delete": 0.3, "expire": 0.3}
    left = vbucket_history(0, 3, **options)  # type: ignore[arg-type]
    right = vbucket_history(0, 3, delay=0.25, **options)  # type: ignore[arg-type]
    for at in range(len(left)):
        for both in (False, True):
            lefts = _mutate(left, op, at) if both else left
            rows = [("left", "upr", "a", i, r) for i, r in enumerate(lefts)]
            rows += [("right", "upr", "c", i, r) for i, r in enumerate(_mutate(right, op, at))]
            data = batches(rows, 5)
            assert results(reconcile_columns, data) == results(reconcile_rows, data), (at, both)
