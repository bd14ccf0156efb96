"""The Spark data source for capture segments: ``spark.read.format("tapupr-capture")``.

Each segment file is one input partition. A partition's reader decodes the
segment's blocks (``gateway.capture.segments``) into Arrow record batches
with the ``SCHEMA`` below: the segment's metadata as constant columns, the
record fields, and ``segment``/``idx`` so that the records of a stream can
be put back in arrival order. Unsigned 64-bit fields travel in Spark's
signed longs bit for bit (values past 2**63 show as negative; equality and
the order of real seqnos are unaffected).

Damage is data, not a crash: a torn last block yields the whole records
before it and one diagnostic row (``kind`` ``TORN``); a damaged segment
yields one diagnostic row (``kind`` ``DAMAGED``) instead of its records.
In both, ``stream`` is the file and ``key`` the message.

Paths are local directories/files, ``file://`` URIs, or any URI
``pyarrow.fs`` opens (``hdfs://``, ``s3://``, ``gs://``...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from gateway.capture.records import FIELD_COUNT
from gateway.capture.segments import SegmentError, TornTail, decode_header, iter_blocks
from gateway.verify.inputs import is_local, list_segment_files, local_path

NAME = "tapupr-capture"
TORN = 100
DAMAGED = 101
BATCH_ROWS = 65536

SCHEMA_DDL = (
    "protocol string, connection string, direction string, stream string, segment int, "
    "idx long, kind int, vbucket int, key binary, by_seqno long, rev_seqno long, cas long, "
    "flags long, expiration long, digest binary, checkpoint_id long, snap_start long, "
    "snap_end long, marker_flags long, arrival double"
)
_U64 = pa.uint64()
# Record fields in on-disk order with their Arrow type (u64 fields are viewed as int64).
_RECORD_TYPES: list[tuple[str, pa.DataType]] = [
    ("kind", pa.int32()),
    ("vbucket", pa.int32()),
    ("key", pa.binary()),
    ("by_seqno", _U64),
    ("rev_seqno", _U64),
    ("cas", _U64),
    ("flags", pa.int64()),
    ("expiration", pa.int64()),
    ("digest", pa.binary()),
    ("checkpoint_id", _U64),
    ("snap_start", _U64),
    ("snap_end", _U64),
    ("marker_flags", pa.int64()),
    ("arrival", pa.float64()),
]
assert len(_RECORD_TYPES) == FIELD_COUNT
ARROW_SCHEMA = pa.schema(
    [
        ("protocol", pa.string()),
        ("connection", pa.string()),
        ("direction", pa.string()),
        ("stream", pa.string()),
        ("segment", pa.int32()),
        ("idx", pa.int64()),
        *[(name, pa.int64() if kind == _U64 else kind) for name, kind in _RECORD_TYPES],
    ]
)


# -- files ------------------------------------------------------------------------


def read_bytes(path: str) -> bytes:
    if is_local(path):
        with open(local_path(path), "rb") as handle:
            return handle.read()
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    with filesystem.open_input_stream(inner) as stream:
        data: bytes = stream.readall()
        return data


# -- decoding ---------------------------------------------------------------------


def _diagnostic(path: str, kind: int, message: str, offset: int) -> pa.RecordBatch:
    row: dict[str, Any] = {name: None for name in ARROW_SCHEMA.names}
    row.update(stream=path, kind=kind, key=message.encode(), idx=offset, vbucket=-1, segment=-1)
    return pa.RecordBatch.from_pylist([row], schema=ARROW_SCHEMA)


def _batch(meta: dict[str, Any], start: int, records: list[list[Any]]) -> pa.RecordBatch:
    n = len(records)
    columns = list(zip(*records, strict=True)) if records else [() for _ in _RECORD_TYPES]
    arrays: list[pa.Array] = [
        pa.array([meta["protocol"]] * n, pa.string()),
        pa.array([meta["connection"]] * n, pa.string()),
        pa.array([meta["direction"]] * n, pa.string()),
        pa.array([meta["stream"]] * n, pa.string()),
        pa.array([meta["segment"]] * n, pa.int32()),
        pa.array(range(start, start + n), pa.int64()),
    ]
    for (_, kind), values in zip(_RECORD_TYPES, columns, strict=True):
        array = pa.array(values, kind)
        arrays.append(array.view(pa.int64()) if kind == _U64 else array)
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def segment_batches(path: str, data: bytes | None = None) -> Iterator[pa.RecordBatch]:
    """Arrow batches of one segment file, diagnostics included (see the module docstring)."""
    try:
        data = read_bytes(path) if data is None else data
        header, _ = decode_header(data, path)
        meta = {
            "protocol": str(header.get("side", "")),
            "connection": str(header.get("connection", "")),
            "direction": str(header.get("direction", "")),
            "segment": int(header.get("segment", 0)),
        }
        meta["stream"] = f"{meta['connection']}/{meta['direction']}/{header.get('run', '')}"
        pending: list[list[Any]] = []
        start = 0
        for offset, got in iter_blocks(data, path):
            if isinstance(got, TornTail):
                if pending:
                    yield _batch(meta, start, pending)
                    start, pending = start + len(pending), []
                yield _diagnostic(path, TORN, got.describe(), offset)
                continue
            pending.extend(got)
            if len(pending) >= BATCH_ROWS:
                yield _batch(meta, start, pending)
                start, pending = start + len(pending), []
        if pending:
            yield _batch(meta, start, pending)
    except SegmentError as exc:
        yield _diagnostic(path, DAMAGED, str(exc), exc.offset or 0)
    except (OSError, pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        yield _diagnostic(path, DAMAGED, f"{path}: unreadable: {exc}", 0)


# -- Spark ------------------------------------------------------------------------


class SegmentPartition(InputPartition):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class CaptureReader(DataSourceReader):
    def __init__(self, path: str) -> None:
        self.path = path

    def partitions(self) -> list[InputPartition]:
        return [SegmentPartition(p) for p in list_segment_files(self.path)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        yield from segment_batches(partition.path)


class CaptureDataSource(DataSource):
    """``spark.read.format("tapupr-capture").load(PATH)``: one row per capture record."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        path = self.options.get("path")
        if not path:
            raise ValueError(f"{NAME}: give the capture directory to load(PATH)")
        return CaptureReader(str(path))


def register(spark: Any) -> None:
    spark.dataSource.register(CaptureDataSource)
