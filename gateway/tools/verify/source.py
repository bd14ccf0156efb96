"""The Spark data source for capture segments: ``spark.read.format("tapupr-capture")``.

Each segment file is one input partition, read by ``decode``: one row per
record (``SCHEMA_DDL``), or with ``.option("rows", "vbucket-chunks")`` one row
per chunk of a vbucket's records (``CHUNK_DDL``), which is what ``verify``
reads. See ``decode`` for the rows, diagnostics and the paths accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from gateway.tools.verify.decode import CHUNK_DDL, SCHEMA_DDL, segment_batches, segment_chunks
from gateway.tools.verify.inputs import list_segment_files

NAME = "tapupr-capture"
CHUNKS = "vbucket-chunks"


# -- Spark ------------------------------------------------------------------------


class SegmentPartition(InputPartition):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class CaptureReader(DataSourceReader):
    def __init__(self, path: str, chunks: bool = False) -> None:
        self.path = path
        self.chunks = chunks

    def partitions(self) -> list[InputPartition]:
        return [SegmentPartition(p) for p in list_segment_files(self.path)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPartition)
        if self.chunks:
            yield from segment_chunks(partition.path)
        else:
            yield from segment_batches(partition.path)


class CaptureDataSource(DataSource):
    """``spark.read.format("tapupr-capture").load(PATH)``: one row per capture record;
    with ``.option("rows", "vbucket-chunks")``, one row per vbucket chunk (``CHUNK_DDL``)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def _chunks(self) -> bool:
        rows = self.options.get("rows", "records")
        if rows not in ("records", CHUNKS):
            raise ValueError(f"{NAME}: option rows is 'records' or '{CHUNKS}', not {rows!r}")
        return rows == CHUNKS

    def schema(self) -> str:
        return CHUNK_DDL if self._chunks() else SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        path = self.options.get("path")
        if not path:
            raise ValueError(f"{NAME}: give the capture directory to load(PATH)")
        return CaptureReader(str(path), self._chunks())


def register(spark: Any) -> None:
    spark.dataSource.register(CaptureDataSource)
