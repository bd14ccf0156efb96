"""What a Spark task runs: the checks over the records of whole vbuckets.

``reconcile_batches`` is given the records of both sides sorted by vbucket,
side and stream (in any order between streams), segment and idx, so each
vbucket arrives whole, each stream together and in arrival order; in the job
``reconcile_chunk_batches`` (``mapInArrow``) gives it those records unpacked
from vbucket chunks (``decode.segment_chunks``) repartitioned by vbucket and
sorted the same way. It gathers one vbucket at a time and
``columnar.split`` sets aside, on the vbucket's Arrow columns, the streams
and keys that might hold a fault; only those become Python records, for
``streams.check_stream`` and ``checks.reconcile_key`` (``reconcile_rows``, the
same with a record object for everything, is the reference it is tested
against and what runs without numpy). It yields result rows
(``RESULT_DDL``): one ``mismatch`` row per fault, one ``in_flight`` row per
key that differs only by changes past the vbucket's cut (``CUT`` records),
one ``stats`` row per vbucket (counts and the latency histogram), and the
data source's diagnostic rows passed through as ``diagnostic`` rows.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from gateway.tools.capture.records import CaptureRecord, Kind
from gateway.tools.verify.checks import FinalState, Mismatch, agreeing_latencies, reconcile_key
from gateway.tools.verify.decode import RECORD_SCHEMA, chunk_records
from gateway.tools.verify.latency import Histogram
from gateway.tools.verify.streams import check_stream

try:
    from gateway.tools.verify import columnar
except ImportError:  # numpy missing
    columnar = None  # type: ignore[assignment]

RECORD_COLUMNS = (
    "kind",
    "vbucket",
    "key",
    "by_seqno",
    "rev_seqno",
    "cas",
    "flags",
    "expiration",
    "digest",
    "checkpoint_id",
    "snap_start",
    "snap_end",
    "marker_flags",
    "arrival",
)
_UNSIGNED = frozenset({"by_seqno", "rev_seqno", "cas", "checkpoint_id", "snap_start", "snap_end"})
INPUT_COLUMNS = ("side", "protocol", "stream", *RECORD_COLUMNS)
_INPUT_SCHEMA = pa.schema([*((name, pa.string()) for name in INPUT_COLUMNS[:3]), *RECORD_SCHEMA])
CHUNK_COLUMNS = ("side", "protocol", "stream", "vbucket", "kind", "payload")
OUTPUT_ROWS = 8192
_CUT = int(Kind.CUT)

_STATE_FIELDS = ("kind", "by_seqno", "rev_seqno", "cas", "flags", "expiration", "digest")
RESULT_ARROW = pa.schema(
    [
        ("row_type", pa.string()),
        ("check", pa.string()),
        ("vbucket", pa.int32()),
        ("key", pa.binary()),
        ("side", pa.string()),
        ("detail", pa.string()),
        *[
            (
                f"{side}_{name}",
                pa.string() if name == "kind" else pa.binary() if name == "digest" else pa.int64(),
            )
            for side in ("left", "right")
            for name in _STATE_FIELDS
        ],
        ("left_records", pa.int64()),
        ("right_records", pa.int64()),
        ("left_items", pa.int64()),
        ("right_items", pa.int64()),
        ("keys", pa.int64()),
        ("in_flight", pa.int64()),
        ("lat_count", pa.int64()),
        ("lat_sum", pa.float64()),
        ("lat_min", pa.float64()),
        ("lat_max", pa.float64()),
        ("lat_hist", pa.list_(pa.int64())),
    ]
)
_SPARK_TYPES = {
    pa.string(): "string",
    pa.binary(): "binary",
    pa.int32(): "int",
    pa.int64(): "long",
    pa.float64(): "double",
    pa.list_(pa.int64()): "array<long>",
}
RESULT_DDL = ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in RESULT_ARROW)
_SIGN = 1 << 63
_WRAP = 1 << 64


def _signed(value: int | None) -> int | None:
    """A u64 as Spark's long, bit for bit."""
    return None if value is None else value - _WRAP if value >= _SIGN else value


class _Output:
    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in RESULT_ARROW.names}
        self.rows = 0

    def add(self, row: dict[str, Any]) -> None:
        for name, values in self.columns.items():
            values.append(row.get(name))
        self.rows += 1

    def take(self) -> pa.RecordBatch:
        batch = pa.RecordBatch.from_pydict(self.columns, schema=RESULT_ARROW)
        self.columns = {name: [] for name in RESULT_ARROW.names}
        self.rows = 0
        return batch

    def mismatch(self, m: Mismatch, row_type: str = "mismatch") -> None:
        row: dict[str, Any] = {
            "row_type": row_type,
            "check": str(m.check),
            "vbucket": m.vbucket,
            "key": m.key,
            "side": m.side,
            "detail": m.detail,
        }
        for side, state in (("left", m.left), ("right", m.right)):
            if state is not None:
                _put_state(row, side, state)
        self.add(row)


def _put_state(row: dict[str, Any], side: str, state: FinalState) -> None:
    row[f"{side}_kind"] = Kind(state.kind).label
    row[f"{side}_by_seqno"] = _signed(state.by_seqno)
    row[f"{side}_rev_seqno"] = _signed(state.rev_seqno)
    row[f"{side}_cas"] = _signed(state.cas)
    row[f"{side}_flags"] = state.flags
    row[f"{side}_expiration"] = state.expiration
    row[f"{side}_digest"] = state.digest


class _Vbucket:
    """The records of one vbucket, by stream and by key."""

    def __init__(self, vbucket: int) -> None:
        self.vbucket = vbucket
        self.streams: list[tuple[str, str, list[CaptureRecord]]] = []
        self.keys: dict[
            bytes, tuple[dict[str, list[CaptureRecord]], dict[str, list[CaptureRecord]]]
        ] = {}
        self.items = [0, 0]
        """Item records on the right, on the left (indexed by ``side == "left"``)."""
        self._side: str | None = None
        self._stream_name: str | None = None
        self._left = True
        self._current: list[CaptureRecord] = []
        self.cuts: dict[str, int] = {}
        """Each side's CUT (a CAS) for this vbucket, if it has one."""

    @property
    def cut(self) -> int | None:
        """The point both sides claim to have reached: the lower of their cuts."""
        return min(self.cuts.values()) if self.cuts else None

    def add(self, side: str, protocol: str, stream: str, r: CaptureRecord) -> None:
        kind = r.kind
        if kind == _CUT:
            self.cuts[side] = min(r.cas, self.cuts.get(side, r.cas))
            return
        if stream != self._stream_name or side != self._side:
            self._side, self._stream_name = side, stream
            self._left = side == "left"
            self._current = []
            self.streams.append((side, protocol, self._current))
        self._current.append(r)
        if kind < 10:
            self.items[self._left] += 1
            entry = self.keys.get(r.key)
            if entry is None:
                entry = self.keys[r.key] = ({}, {})
            by_stream = entry[0 if self._left else 1]
            records = by_stream.get(stream)
            if records is None:
                by_stream[stream] = [r]
            else:
                records.append(r)

    def finish(self, out: _Output) -> None:
        vb = self.vbucket
        for side, protocol, records in self.streams:
            for m in check_stream(side, protocol, vb, records):
                out.mismatch(m)
        in_flight, lags = self.reconcile_keys(out)
        hist = Histogram()
        hist.add_all(lags)
        counted = {"left": 0, "right": 0}
        for side, _, stream_records in self.streams:
            counted[side] += len(stream_records)
        items = {"left": self.items[True], "right": self.items[False]}
        _stats(out, vb, counted, items, len(self.keys), in_flight, hist)

    def reconcile_keys(self, out: _Output) -> tuple[int, list[float]]:
        """Every key's checks: the keys in flight and the latencies."""
        vb = self.vbucket
        cut = self.cut
        in_flight = 0
        lags: list[float] = []
        for key, (left_streams, right_streams) in self.keys.items():
            left, right = list(left_streams.values()), list(right_streams.values())
            agreed = agreeing_latencies(left, right, cut)
            if agreed is not None:
                lags += agreed
                continue
            outcome = reconcile_key(vb, key, left, right, cut)
            for m in outcome.mismatches:
                out.mismatch(m)
            if outcome.in_flight:
                in_flight += 1
                out.mismatch(outcome.in_flight[0], "in_flight")
            lags += outcome.latencies
        return in_flight, lags


def _stats(
    out: _Output,
    vb: int,
    records: dict[str, int],
    items: dict[str, int],
    keys: int,
    in_flight: int,
    hist: Histogram,
) -> None:
    out.add(
        {
            "row_type": "stats",
            "vbucket": vb,
            "left_records": records["left"],
            "right_records": records["right"],
            "left_items": items["left"],
            "right_items": items["right"],
            "keys": keys,
            "in_flight": in_flight,
            "lat_count": hist.count,
            "lat_sum": hist.total,
            "lat_min": hist.low if hist.count else None,
            "lat_max": hist.high if hist.count else None,
            "lat_hist": hist.counts if hist.count else None,
        }
    )


def _column(batch: pa.RecordBatch, name: str) -> list[Any]:
    array = batch.column(name)
    if name in _UNSIGNED:
        array = array.view(pa.uint64())
    values: list[Any] = array.to_pylist()
    return values


def _rows(batch: pa.RecordBatch) -> Iterator[tuple[str, str, str, CaptureRecord]]:
    """(side, protocol, stream, record) of each row."""
    records = map(
        CaptureRecord._make, zip(*(_column(batch, c) for c in RECORD_COLUMNS), strict=True)
    )
    yield from zip(
        _column(batch, "side"),
        _column(batch, "protocol"),
        _column(batch, "stream"),
        records,
        strict=True,
    )


def _diagnostic(out: _Output, side: str, stream: str | None, r: CaptureRecord) -> None:
    out.add(
        {
            "row_type": "diagnostic",
            "check": "torn" if r.kind == 100 else "damaged",
            "side": side,
            "detail": (r.key or b"").decode("utf-8", "replace"),
            "key": stream.encode() if stream else None,
        }
    )


def reconcile_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body (see the module docstring)."""
    # A vbucket is millions of small objects and no cycles: the collector's full
    # passes over them would cost more than the checks.
    collecting = gc.isenabled()
    gc.disable()
    try:
        if columnar is None:  # no numpy on this executor: every record in Python
            yield from reconcile_rows(batches)
        else:
            yield from reconcile_columns(batches)
    finally:
        if collecting:
            gc.enable()


def reconcile_chunk_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over vbucket chunks (``CHUNK_COLUMNS``, see the module docstring)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield from reconcile_batches(_chunk_records(batches))
    finally:
        if collecting:
            gc.enable()


def _chunk_records(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The records of chunk rows in their order, as ``INPUT_COLUMNS`` batches."""
    for batch in batches:
        columns = [batch.column(name) for name in ("side", "protocol", "stream", "kind")]
        payloads = batch.column("payload")
        for i, (side, protocol, stream, kind) in enumerate(zip(*columns, strict=True)):
            if kind.as_py() >= 100:  # a diagnostic: its message is the payload
                yield _diagnostic_records(side, stream, kind, payloads[i].as_py())
                continue
            records = chunk_records(payloads[i].as_buffer())
            n = records.num_rows
            constants = [pa.repeat(value, n) for value in (side, protocol, stream)]
            yield pa.RecordBatch.from_arrays(
                [*constants, *records.columns], names=[*INPUT_COLUMNS[:3], *records.schema.names]
            )


def _diagnostic_records(side: Any, stream: Any, kind: Any, message: bytes) -> pa.RecordBatch:
    row: dict[str, Any] = dict.fromkeys(INPUT_COLUMNS)
    row.update(side=side.as_py(), stream=stream.as_py(), kind=kind.as_py(), key=message)
    row.update(vbucket=-1, protocol="")
    return pa.RecordBatch.from_pylist([row], schema=_INPUT_SCHEMA)


def reconcile_rows(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The checks with a Python object per record (the reference for ``reconcile_columns``)."""
    out = _Output()
    current: _Vbucket | None = None
    for batch in batches:
        for side, protocol, stream, r in _rows(batch):
            if r.kind >= 100:
                _diagnostic(out, side, stream, r)
                continue
            if current is None or r.vbucket != current.vbucket:
                if current is not None:
                    current.finish(out)
                current = _Vbucket(r.vbucket)
            current.add(side, protocol, stream, r)
            if out.rows >= OUTPUT_ROWS:
                yield out.take()
    if current is not None:
        current.finish(out)
    if out.rows:
        yield out.take()


def reconcile_columns(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The same results, each vbucket taken whole on its columns (``columnar``)."""
    assert columnar is not None
    out = _Output()
    pending: list[pa.RecordBatch] = []
    current = None
    for batch in batches:
        damage = pc.greater_equal(batch.column("kind"), 100)
        if pc.any(damage).as_py():
            for side, _, stream, r in _rows(batch.filter(damage)):
                _diagnostic(out, side, stream, r)
            batch = batch.filter(pc.invert(damage))
        for start, stop, vb in columnar.runs(batch.column("vbucket")):
            if vb != current and pending:
                _finish_columns(current, pending, out)  # type: ignore[arg-type]
                pending = []
            current = vb
            pending.append(batch.slice(start, stop - start))
        if out.rows >= OUTPUT_ROWS:
            yield out.take()
    if pending:
        _finish_columns(current, pending, out)  # type: ignore[arg-type]
    if out.rows:
        yield out.take()


def _finish_columns(vb: int, slices: list[pa.RecordBatch], out: _Output) -> None:
    assert columnar is not None
    table = pa.Table.from_batches(slices).combine_chunks()
    kind = table.column("kind").to_numpy()
    is_cut = kind == _CUT
    keys = _Vbucket(vb)
    if is_cut.any():
        for side, _, _, r in _rows(_batch(table.filter(pa.array(is_cut)))):
            keys.cuts[side] = min(r.cas, keys.cuts.get(side, r.cas))
        table = table.filter(pa.array(~is_cut))
        kind = kind[~is_cut]
    found = columnar.split(table, keys.cut)
    for start, stop in found.slow_streams:
        rows = list(_rows(_batch(table.slice(start, stop - start))))
        side, protocol = rows[0][0], rows[0][1]
        for m in check_stream(side, protocol, vb, [r for _, _, _, r in rows]):
            out.mismatch(m)
    if len(found.slow_key_rows):
        for side, protocol, stream, r in _rows(_batch(table.take(pa.array(found.slow_key_rows)))):
            keys.add(side, protocol, stream, r)
    in_flight, lags = keys.reconcile_keys(out)
    hist = Histogram()
    hist.merge(*columnar.histogram(found.latencies))
    hist.add_all(lags)
    left = pc.equal(table.column("side"), "left").to_numpy(zero_copy_only=False)
    item = kind < 10
    records = {"left": int(left.sum()), "right": int((~left).sum())}
    items = {"left": int((item & left).sum()), "right": int((item & ~left).sum())}
    _stats(out, vb, records, items, found.keys, in_flight, hist)


def _batch(table: pa.Table) -> pa.RecordBatch:
    return table.combine_chunks().to_batches()[0]
