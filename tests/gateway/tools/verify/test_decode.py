"""Segments as Arrow: record rows and vbucket chunks give back every record, in order."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow", reason="needs the pipeline extra")

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from gateway.tools.capture import CaptureRecord, Kind
from gateway.tools.capture.segments import SegmentWriter, encode_block
from gateway.tools.verify import decode
from gateway.tools.verify.decode import (
    DAMAGED,
    TORN,
    chunk_records,
    segment_batches,
    segment_chunks,
)
from gateway.tools.verify.partition import (
    CHUNK_COLUMNS,
    INPUT_COLUMNS,
    reconcile_chunk_batches,
    reconcile_columns,
)
from gateway.tools.verify.synthetic import vbucket_history

_U64 = {"by_seqno", "rev_seqno", "cas", "checkpoint_id", "snap_start", "snap_end"}
u64 = st.integers(0, 2**64 - 1)
records_strategy = st.builds(
    CaptureRecord,
    kind=st.sampled_from([int(k) for k in Kind]),
    vbucket=st.integers(0, 3),
    key=st.binary(max_size=6),
    by_seqno=st.none() | u64,
    rev_seqno=st.none() | u64,
    cas=u64,
    flags=st.integers(0, 2**32 - 1),
    expiration=st.integers(0, 2**32 - 1),
    digest=st.none() | st.binary(min_size=16, max_size=16),
    checkpoint_id=st.none() | u64,
    snap_start=st.none() | u64,
    snap_end=st.none() | u64,
    marker_flags=st.integers(0, 255),
    arrival=st.floats(allow_nan=False, allow_infinity=False),
)


def _signed(value: int | None) -> int | None:
    return None if value is None else value - (1 << 64) if value >= 1 << 63 else value


def as_row(r: CaptureRecord) -> dict[str, Any]:
    """A record as the data source shows it (u64 fields in signed longs)."""
    return {k: _signed(v) if k in _U64 else v for k, v in r._asdict().items()}


def write(tmp_path: Path, records: list[CaptureRecord], block_records: int) -> Path:
    writer = SegmentWriter(
        tmp_path, side="upr", connection="c", direction="received", block_records=block_records
    )
    writer.write(records)
    writer.close()
    (path,) = writer.paths
    return path


def chunks_by_vbucket(path: Path, data: bytes | None = None) -> dict[int, list[dict[str, Any]]]:
    """Each vbucket's records from its chunks in ``idx`` order; checks each chunk's ``idx``."""
    rows = [r for b in segment_chunks(str(path), data) for r in b.to_pylist()]
    out: dict[int, list[dict[str, Any]]] = {}
    for row in sorted((r for r in rows if r["kind"] == 0), key=lambda r: (r["vbucket"], r["idx"])):
        records = chunk_records(row["payload"]).to_pylist()
        assert len(records) == row["records"] > 0
        assert {r["vbucket"] for r in records} == {row["vbucket"]}
        out.setdefault(row["vbucket"], []).extend(records)
    return out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    records=st.lists(records_strategy, max_size=40),
    block_records=st.integers(1, 7),
    batch_rows=st.integers(1, 12),
    window=st.integers(1, 3),
)
def test_records_and_chunks_give_back_every_record(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    records: list[CaptureRecord],
    block_records: int,
    batch_rows: int,
    window: int,
) -> None:
    monkeypatch.setattr(decode, "BATCH_ROWS", batch_rows)
    monkeypatch.setattr(decode, "WINDOW_BATCHES", window)
    path = write(tmp_path_factory.mktemp("seg"), records, block_records)
    rows = [r for b in segment_batches(str(path)) for r in b.to_pylist()]
    assert [r["idx"] for r in rows] == list(range(len(records)))
    assert {(r["protocol"], r["connection"], r["direction"], r["segment"]) for r in rows} <= {
        ("upr", "c", "received", 0)
    }
    assert [{k: r[k] for k in CaptureRecord._fields} for r in rows] == [as_row(r) for r in records]
    # Chunks: each vbucket's records, in their order in the segment.
    expected: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        expected.setdefault(r.vbucket, []).append(as_row(r))
    assert chunks_by_vbucket(path) == expected
    assert gc.isenabled()


def test_a_chunk_starts_at_its_first_record() -> None:
    interleaved = [
        CaptureRecord(1, vb, b"k%d" % i, i, 1, i, 0, 0, None, None, 1, 9, 0, 0.0)
        for i, vb in enumerate([2, 1, 2, 2, 1, 3])
    ]
    batch = decode._concat([decode._block_arrays([list(r) for r in interleaved])])
    got = [
        (vb, first, part.column("key").to_pylist()) for vb, first, part in decode._by_vbucket(batch)
    ]
    assert got == [(1, 1, [b"k1", b"k4"]), (2, 0, [b"k0", b"k2", b"k3"]), (3, 5, [b"k5"])]


def test_a_torn_tail_keeps_the_whole_records_in_both_forms(tmp_path: Path) -> None:
    records = [
        CaptureRecord(1, i % 3, b"k%d" % i, i, 1, i, 0, 0, None, None, 1, 30, 0, 0.0)
        for i in range(30)
    ]
    path = write(tmp_path, records, 4)
    data = path.read_bytes()[:-3]
    rows = [r for b in segment_batches(str(path), data) for r in b.to_pylist()]
    assert [r["kind"] for r in rows][-1] == TORN and "torn last block" in rows[-1]["key"].decode()
    kept = [as_row(r) for r in records[:29]]
    assert [{k: r[k] for k in CaptureRecord._fields} for r in rows[:-1]] == kept
    chunks = [r for b in segment_chunks(str(path), data) for r in b.to_pylist()]
    (torn,) = [r for r in chunks if r["kind"] == TORN]
    assert torn["stream"] == str(path) and b"torn last block" in torn["payload"]
    got = chunks_by_vbucket(path, data)
    assert [r for vb in sorted(got) for r in got[vb]] == sorted(kept, key=lambda r: r["vbucket"])


def test_a_damaged_block_is_one_diagnostic(tmp_path: Path) -> None:
    records = [CaptureRecord(1, 0, b"k", i, 1, i, 0, 0, None, None, 1, 9, 0, 0.0) for i in range(9)]
    path = write(tmp_path, records, 4)
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF
    data = bytes(raw) + encode_block([])  # the bad block is no longer the last one
    (row,) = [
        r for b in segment_batches(str(path), data) for r in b.to_pylist() if r["kind"] >= 100
    ]
    assert row["kind"] == DAMAGED and b"checksum" in row["key"]
    (chunk,) = [r for b in segment_chunks(str(path), data) for r in b.to_pylist() if r["kind"]]
    assert chunk["kind"] == DAMAGED and b"checksum" in chunk["payload"]
    foreign = tmp_path / "foreign.tucap"
    foreign.write_bytes(b"not a segment at all")
    (row,) = [r for b in segment_chunks(str(foreign)) for r in b.to_pylist()]
    assert row["kind"] == DAMAGED and row["vbucket"] == -1


def _interleaved(histories: list[list[CaptureRecord]]) -> list[CaptureRecord]:
    """The vbuckets' streams merged round-robin, as a live capture sees them."""
    out: list[CaptureRecord] = []
    for i in range(max(map(len, histories))):
        out += [h[i] for h in histories if i < len(h)]
    return out


def _job_rows(paths: dict[str, Path]) -> tuple[list[Any], list[Any]]:
    """Chunk rows and record rows of both sides, sorted as the job sorts them."""
    tables: dict[str, list[Any]] = {"chunks": [], "records": []}
    for side, path in paths.items():
        for name, read in (("chunks", segment_chunks), ("records", segment_batches)):
            table = pa.Table.from_batches(list(read(str(path))))
            tables[name].append(table.append_column("side", pa.repeat(side, table.num_rows)))
    order = [(c, "ascending") for c in ("vbucket", "side", "stream", "segment", "idx")]
    chunks = pa.concat_tables(tables["chunks"]).sort_by(order).select(list(CHUNK_COLUMNS))
    records = pa.concat_tables(tables["records"]).sort_by(order).select(list(INPUT_COLUMNS))
    return chunks.to_batches(max_chunksize=3), records.to_batches(max_chunksize=50)


@pytest.mark.parametrize("fault", [None, "value", "drop"])
def test_chunks_check_as_the_records_do(tmp_path: Path, fault: str | None) -> None:
    pytest.importorskip("numpy", reason="needs the pipeline extra")
    histories = [vbucket_history(vb, 20, snapshot_items=4) for vb in range(4)]
    right = [vbucket_history(vb, 20, snapshot_items=4, delay=0.01) for vb in range(4)]
    if fault == "value":  # on a key written once, so it is its final state
        keys = [r.key for r in right[2]]
        at = next(i for i, r in enumerate(right[2]) if r.kind < 10 and keys.count(r.key) == 1)
        right[2][at] = right[2][at]._replace(digest=b"\0" * 16)
    elif fault == "drop":
        del right[1][7]
    paths = {
        "left": write(tmp_path / "l", _interleaved(histories), 8),
        "right": write(tmp_path / "r", _interleaved(right), 5),
    }
    chunk_batches, record_batches = _job_rows(paths)
    got = sorted(
        (r for b in reconcile_chunk_batches(iter(chunk_batches)) for r in b.to_pylist()), key=repr
    )
    want = sorted(
        (r for b in reconcile_columns(iter(record_batches)) for r in b.to_pylist()), key=repr
    )
    assert got == want
    assert len([r for r in got if r["row_type"] == "stats"]) == 4
    assert any(r["row_type"] == "mismatch" for r in got) == (fault is not None)
