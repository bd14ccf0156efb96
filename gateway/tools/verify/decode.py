"""Capture segments as Arrow: what the ``tapupr-capture`` data source reads (``source``).

A segment's blocks (``gateway.tools.capture.segments``) become Arrow record
batches: ``segment_batches`` gives ``ARROW_SCHEMA`` rows, the segment's
metadata as constant columns, the record fields, and ``segment``/``idx`` so
that the records of a stream can be put back in arrival order. Unsigned
64-bit fields travel in Spark's signed longs bit for bit (values past 2**63
show as negative; equality and the order of real seqnos are unaffected).

``segment_chunks`` gives instead one row per chunk of a segment's records of
one vbucket (``CHUNK_SCHEMA``): up to ``WINDOW_BATCHES * BATCH_ROWS``
records serialized as one Arrow record batch (``RECORD_SCHEMA``,
LZ4-compressed buffers; ``idx`` is its first record's). That is what
``verify`` shuffles: a few large rows cost Spark far less to move and sort
than a row per record, and the chunks of a vbucket, ordered by stream,
segment and ``idx``, give back its records in arrival order
(``chunk_records``).

Decoding builds each block's columns at once with the garbage collector
paused: its passes over the decoded records took most of the decoding time.

Damage is data, not a crash: a torn last block yields the whole records
before it and one diagnostic row (``kind`` ``TORN``); a damaged segment
yields one diagnostic row (``kind`` ``DAMAGED``) instead of its records.
In both, ``stream`` is the file and ``key`` (a chunk's ``payload``) the message.

Paths are local directories/files, ``file://`` URIs, or any URI
``pyarrow.fs`` opens (``hdfs://``, ``s3://``, ``gs://``...).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from gateway.tools.capture.records import FIELD_COUNT
from gateway.tools.capture.segments import SegmentError, TornTail, decode_header, iter_blocks
from gateway.tools.verify.inputs import is_local, local_path

TORN = 100
DAMAGED = 101
BATCH_ROWS = 65536
WINDOW_BATCHES = 16
"""Batches grouped by vbucket at once: a live capture interleaves its vbuckets, and
each chunk costs about as much as a hundred records to pack and unpack."""
# Chunks travel compressed: a third of the bytes for the JVM to shuffle, sort and hand
# to the checks, for less CPU than it saves there (measured).
_COMPRESSED = pa.ipc.IpcWriteOptions(compression="lz4") if pa.Codec.is_available("lz4") else None

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
_META = ("protocol", "connection", "direction", "stream", "segment")
_META_FIELDS = [(name, pa.int32() if name == "segment" else pa.string()) for name in _META]
RECORD_SCHEMA = pa.schema(
    [(name, pa.int64() if kind == _U64 else kind) for name, kind in _RECORD_TYPES]
)
ARROW_SCHEMA = pa.schema([*_META_FIELDS, ("idx", pa.int64()), *RECORD_SCHEMA])
CHUNK_DDL = (
    "protocol string, connection string, direction string, stream string, segment int, "
    "idx long, vbucket int, kind int, records long, payload binary"
)
CHUNK_SCHEMA = pa.schema(
    [
        *_META_FIELDS,
        ("idx", pa.int64()),
        ("vbucket", pa.int32()),
        ("kind", pa.int32()),
        ("records", pa.int64()),
        ("payload", pa.binary()),
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


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Decoding makes a list per record and no cycles: the collector's passes over
    them would cost more than the decoding (most of it, measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _diagnostic(path: str, kind: int, message: str, offset: int) -> pa.RecordBatch:
    row: dict[str, Any] = {name: None for name in ARROW_SCHEMA.names}
    row.update(stream=path, kind=kind, key=message.encode(), idx=offset, vbucket=-1, segment=-1)
    return pa.RecordBatch.from_pylist([row], schema=ARROW_SCHEMA)


def _block_arrays(records: list[list[Any]]) -> list[pa.Array]:
    """One block's records as a column each (u64 fields as uint64)."""
    if not records:
        return [pa.array([], kind) for _, kind in _RECORD_TYPES]
    return [
        pa.array(values, kind)
        for (_, kind), values in zip(_RECORD_TYPES, zip(*records, strict=True), strict=True)
    ]


def _concat(blocks: list[list[pa.Array]]) -> pa.RecordBatch:
    columns = []
    for (_, kind), parts in zip(_RECORD_TYPES, zip(*blocks, strict=True), strict=True):
        array = parts[0] if len(parts) == 1 else pa.concat_arrays(list(parts))
        columns.append(array.view(pa.int64()) if kind == _U64 else array)
    return pa.RecordBatch.from_arrays(columns, schema=RECORD_SCHEMA)


def record_batches(data: bytes, path: str) -> Iterator[tuple[int, pa.RecordBatch | TornTail]]:
    """(index of the first record, its records as ``RECORD_SCHEMA``), about ``BATCH_ROWS``
    at a time, and at most one (offset, ``TornTail``) last; ``SegmentError`` if damaged."""
    blocks = iter_blocks(data, path)
    start = offset = 0
    while True:
        got: list[list[Any]] | TornTail | None = None
        arrays: list[list[pa.Array]] = []
        rows = 0
        with _collector_paused():
            for at, got in blocks:
                if isinstance(got, TornTail):
                    offset = at
                    break
                arrays.append(_block_arrays(got))
                rows += len(got)
                if rows >= BATCH_ROWS:
                    break
            else:
                got = None
            batch = _concat(arrays) if arrays else None
        if batch is not None:
            yield start, batch
            start += rows
        if isinstance(got, TornTail):
            yield offset, got
            return
        if got is None:
            return


def _header_meta(data: bytes, path: str) -> dict[str, Any]:
    header, _ = decode_header(data, path)
    meta = {
        "protocol": str(header.get("side", "")),
        "connection": str(header.get("connection", "")),
        "direction": str(header.get("direction", "")),
        "segment": int(header.get("segment", 0)),
    }
    meta["stream"] = f"{meta['connection']}/{meta['direction']}/{header.get('run', '')}"
    return meta


def _constant(value: Any, kind: pa.DataType, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, kind), n)


def segment_batches(path: str, data: bytes | None = None) -> Iterator[pa.RecordBatch]:
    """Arrow batches of one segment file, diagnostics included (see the module docstring)."""
    try:
        data = read_bytes(path) if data is None else data
        meta = _header_meta(data, path)
        for start, got in record_batches(data, path):
            if isinstance(got, TornTail):
                yield _diagnostic(path, TORN, got.describe(), start)
                continue
            n = got.num_rows
            arrays = [
                *(_constant(meta[name], pa.string(), n) for name in _META[:4]),
                _constant(meta["segment"], pa.int32(), n),
                pa.array(range(start, start + n), pa.int64()),
                *got.columns,
            ]
            yield pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)
    except SegmentError as exc:
        yield _diagnostic(path, DAMAGED, str(exc), exc.offset or 0)
    except (OSError, pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        yield _diagnostic(path, DAMAGED, f"{path}: unreadable: {exc}", 0)


# -- vbucket chunks -----------------------------------------------------------------


def _chunk_diagnostic(path: str, kind: int, message: str, offset: int) -> pa.RecordBatch:
    row: dict[str, Any] = {name: None for name in CHUNK_SCHEMA.names}
    row.update(stream=path, kind=kind, payload=message.encode(), idx=offset, vbucket=-1)
    row.update(segment=-1, records=0)
    return pa.RecordBatch.from_pylist([row], schema=CHUNK_SCHEMA)


def _by_vbucket(batch: pa.RecordBatch) -> Iterator[tuple[int, int, pa.RecordBatch]]:
    """(vbucket, index of its first record in ``batch``, its records in order) per vbucket."""
    runs = pc.run_end_encode(batch.column("vbucket"))
    if len(runs.values) == pc.count_distinct(runs.values).as_py():  # one run each: slices
        ends = runs.run_ends.to_pylist()
        for begin, end, vb in zip([0, *ends[:-1]], ends, runs.values.to_pylist(), strict=True):
            yield vb, begin, batch.slice(begin, end - begin)
        return
    order = pc.sort_indices(batch.column("vbucket"))  # stable: each keeps its order
    ordered = batch.take(order)
    runs = pc.run_end_encode(ordered.column("vbucket"))
    begin = 0
    for end, vb in zip(runs.run_ends.to_pylist(), runs.values.to_pylist(), strict=True):
        yield vb, order[begin].as_py(), ordered.slice(begin, end - begin)
        begin = end


def _windows(data: bytes, path: str) -> Iterator[tuple[int, pa.RecordBatch | TornTail]]:
    """``record_batches`` merged into windows of ``WINDOW_BATCHES`` batches."""
    pending: list[pa.RecordBatch] = []
    first = 0

    def merged() -> pa.RecordBatch:
        if len(pending) == 1:
            return pending[0]
        return pa.Table.from_batches(pending).combine_chunks().to_batches()[0]

    for start, got in record_batches(data, path):
        if isinstance(got, TornTail):
            if pending:
                yield first, merged()
                pending = []
            yield start, got
            continue
        if not pending:
            first = start
        pending.append(got)
        if len(pending) >= WINDOW_BATCHES:
            yield first, merged()
            pending = []
    if pending:
        yield first, merged()


def segment_chunks(path: str, data: bytes | None = None) -> Iterator[pa.RecordBatch]:
    """One segment file as ``CHUNK_SCHEMA`` rows: per vbucket and window of up to
    ``WINDOW_BATCHES * BATCH_ROWS`` records, those records as one Arrow record batch."""
    try:
        data = read_bytes(path) if data is None else data
        meta = _header_meta(data, path)
        for start, got in _windows(data, path):
            if isinstance(got, TornTail):
                yield _chunk_diagnostic(path, TORN, got.describe(), start)
                continue
            rows: dict[str, list[Any]] = {name: [] for name in CHUNK_SCHEMA.names}
            for vb, first, records in _by_vbucket(got):
                for name in _META:
                    rows[name].append(meta[name])
                rows["idx"].append(start + first)
                rows["vbucket"].append(vb)
                rows["kind"].append(0)
                rows["records"].append(records.num_rows)
                rows["payload"].append(_serialize(records))
            yield pa.RecordBatch.from_pydict(rows, schema=CHUNK_SCHEMA)
    except SegmentError as exc:
        yield _chunk_diagnostic(path, DAMAGED, str(exc), exc.offset or 0)
    except (OSError, pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        yield _chunk_diagnostic(path, DAMAGED, f"{path}: unreadable: {exc}", 0)


def _serialize(records: pa.RecordBatch) -> bytes:
    """One IPC record batch message, its buffers LZ4-compressed where pyarrow can."""
    if _COMPRESSED is None:
        return bytes(records.serialize().to_pybytes())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, RECORD_SCHEMA, options=_COMPRESSED) as writer:
        writer.write_batch(records)
    messages = pa.ipc.MessageReader.open_stream(sink.getvalue())
    messages.read_next_message()  # the schema, which readers know
    return bytes(messages.read_next_message().serialize().to_pybytes())


def chunk_records(payload: Any) -> pa.RecordBatch:
    """The records of one chunk's ``payload`` (a ``pa.Buffer`` or bytes), no copy."""
    buffer = payload if isinstance(payload, pa.Buffer) else pa.py_buffer(payload)
    return pa.ipc.read_record_batch(buffer, RECORD_SCHEMA)
