"""The reconciliation job on Spark: read two captures, apply the checks, gather a report.

Theory of operation. Both captures are read through the ``tapupr-capture``
data source (one partition per segment file) as vbucket chunks: per segment
and vbucket, its records as one compressed Arrow batch in a single row
(``decode.segment_chunks``), tagged ``left``/``right`` and unioned. One
shuffle of those few large rows puts each vbucket in one partition, each
stream's chunks together in arrival order; ``partition.reconcile_chunk_batches``
(``mapInArrow``) then unpacks the chunks and checks whole vbuckets on their
columns, the few streams and keys that might hold a fault with the pure
checks, and yields mismatch, stats and diagnostic rows. No row per record
is ever made in the JVM: the decoding in the scan is what a plain count of
the captures costs, and Spark moves about 40 compressed bytes per record.
Those results are persisted, so the counts, samples, the latency histogram
and the optional Parquet output cost no second pass over the captures.
Stage timings from ``progress`` split the wall time between the scan
(reading and decoding captures, up to the shuffle) and the reconciliation.

The same code runs in ``local[*]`` (the default) or on a cluster: with
``spark-submit`` the master comes from spark-submit unless ``--master`` is
given (``python -m gateway.tools.verify`` is the entry point). The session ships
the job's own code to the executors (``shipping``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.verify.inputs import InputError, capture_files
from gateway.tools.verify.latency import SIZE, Histogram
from gateway.tools.verify.partition import CHUNK_COLUMNS, RESULT_DDL, reconcile_chunk_batches
from gateway.tools.verify.progress import Progress, ProgressLog
from gateway.tools.verify.shipping import ship, worker_python
from gateway.tools.verify.source import CHUNKS, NAME, register

__all__ = ["InputError", "VerifyConfig", "VerifyResult", "run_verify", "spark_session"]

SAMPLES_PER_CHECK = 20
QUIET_LOG_LEVEL = "ERROR"
ARROW_BATCH_BYTES = 64 * 2**20


@dataclass
class VerifyConfig:
    left: str
    right: str
    master: str | None = None
    """``None``: whatever spark-submit set, else ``local[*]``."""
    report: str | None = None
    mismatches: str | None = None
    partitions: int | None = None
    """Shuffle partitions (default: twice the default parallelism, at least 4 and one per
    segment file)."""
    left_direction: str | None = None
    right_direction: str | None = None
    samples: int = SAMPLES_PER_CHECK
    driver_memory: str = "4g"
    progress: bool = True
    spark_conf: dict[str, str] = field(default_factory=dict)


@dataclass
class VerifyResult:
    report: dict[str, Any]

    @property
    def agree(self) -> bool:
        return bool(self.report["agree"])


def spark_session(
    master: str | None = None,
    *,
    app_name: str = "tap-upr-gateway verify",
    driver_memory: str = "4g",
    shuffle_partitions: int | None = None,
    conf: dict[str, str] | None = None,
) -> Any:
    """A SparkSession for the job: UI off, quiet logs, Arrow on, the capture source registered."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master is None and "SPARK_HOME" not in os.environ and not _submitted():
        master = "local[*]"
    if master is not None:
        builder = builder.master(master)
    local = master is not None and master.startswith("local")
    settings = {
        # Local mode stays on loopback: nothing listens on other interfaces.
        **(
            {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
            if local
            else {}
        ),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": driver_memory,
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.python.worker.reuse": "true",
        **({"spark.sql.shuffle.partitions": str(shuffle_partitions)} if shuffle_partitions else {}),
        **worker_python(conf or {}),
        **(conf or {}),
    }
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(QUIET_LOG_LEVEL)
    ship(spark)  # executors need not have this package installed
    register(spark)
    return spark


def _submitted() -> bool:
    """Running under spark-submit (which passes the master itself)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _side(spark: Any, path: str, label: str, direction: str | None) -> Any:
    from pyspark.sql import functions as F

    df = spark.read.format(NAME).option("rows", CHUNKS).load(path).withColumn("side", F.lit(label))
    if direction:
        df = df.filter((F.col("kind") >= 100) | (F.col("direction") == direction))
    # Only what the checks read crosses the shuffle.
    return df.select(*CHUNK_COLUMNS, "segment", "idx")


def results_frame(spark: Any, left: str, right: str, partitions: int, **filters: Any) -> Any:
    """The result rows (mismatch / stats / diagnostic) of reconciling two capture paths."""
    from pyspark.sql import functions as F

    data = _side(spark, left, "left", filters.get("left_direction")).unionByName(
        _side(spark, right, "right", filters.get("right_direction"))
    )
    return (
        data.repartition(partitions, "vbucket")
        # Fixed-width sort keys: a hash stands for (side, stream), whose order among
        # streams does not matter, only that each stream's records stay together.
        .sortWithinPartitions("vbucket", F.xxhash64("side", "stream"), "segment", "idx")
        .mapInArrow(reconcile_chunk_batches, RESULT_DDL)
    )


def run_verify(config: VerifyConfig, spark: Any = None) -> VerifyResult:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    started = time.monotonic()
    left_files = capture_files(config.left, "LEFT")
    right_files = capture_files(config.right, "RIGHT")
    if spark is None:
        spark = spark_session(
            config.master,
            driver_memory=config.driver_memory,
            shuffle_partitions=config.partitions,
            conf=config.spark_conf,
        )
    # About a segment's worth of records per partition keeps each sort in memory.
    partitions = config.partitions or max(
        4, 2 * spark.sparkContext.defaultParallelism, len(left_files) + len(right_files)
    )
    # The report's own aggregations are small: no 200-way shuffles for them.
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    # Chunks are large rows: bound the Arrow batches handed to the checks by bytes.
    spark.conf.set("spark.sql.execution.arrow.maxBytesPerBatch", str(ARROW_BATCH_BYTES))
    results = results_frame(
        spark,
        config.left,
        config.right,
        partitions,
        left_direction=config.left_direction,
        right_direction=config.right_direction,
    ).persist(StorageLevel.MEMORY_AND_DISK)
    log = ProgressLog()
    try:
        with Progress(spark, log) if config.progress else _NoProgress():
            job_started = time.monotonic()
            # The first action reconciles and fills the cache; the rest read the cache,
            # and ask for samples only where there is something to sample.
            small = results.filter("row_type IN ('stats', 'diagnostic')").collect()
            computed = time.monotonic()
            stats = [r for r in small if r["row_type"] == "stats"]
            diagnostics = [r for r in small if r["row_type"] == "diagnostic"]
            mismatch_rows = results.filter("row_type = 'mismatch'")
            counts = mismatch_rows.groupBy("check", "side", "vbucket").count().collect()
            samples: list[Any] = []
            if counts:
                ranked = mismatch_rows.withColumn(
                    "rank",
                    F.row_number().over(Window.partitionBy("check").orderBy("vbucket", "key")),
                )
                samples = ranked.filter(F.col("rank") <= config.samples).drop("rank").collect()
            in_flight: list[Any] = []
            if any(r["in_flight"] for r in stats):
                in_flight = (
                    results.filter("row_type = 'in_flight'")
                    .orderBy("vbucket", "key")
                    .limit(config.samples)
                    .collect()
                )
            if config.mismatches:
                keep = [
                    c
                    for c in results.columns
                    if not c.startswith(
                        ("lat_", "left_rec", "right_rec", "left_items", "right_items")
                    )
                    and c not in ("keys", "row_type")
                ]
                mismatch_rows.select(*keep).write.mode("overwrite").parquet(config.mismatches)
            finished = time.monotonic()
    finally:
        results.unpersist()
    from gateway.tools.verify.report import build_report

    timing = _timing(log, started, job_started, computed, finished)
    report = build_report(
        config,
        stats=[r.asDict() for r in stats],
        diagnostics=[r.asDict() for r in diagnostics],
        counts=[r.asDict() for r in counts],
        samples=[r.asDict() for r in samples],
        in_flight=[r.asDict() for r in in_flight],
        segments={"left": len(left_files), "right": len(right_files)},
        timing=timing,
        memory={
            "python_driver_peak_rss_bytes": log.python_peak_rss(),
            "jvm_driver_peak_rss_bytes": log.jvm_peak_rss,
            "jvm_heap_peak_bytes": log.jvm_heap_peak,
        },
        master=spark.sparkContext.master,
        partitions=partitions,
    )
    return VerifyResult(report)


def _timing(
    log: ProgressLog, started: float, job_started: float, computed: float, finished: float
) -> dict[str, float]:
    """Wall times; the scan/reconcile split comes from the first job's two stages."""
    stages = sorted(log.stages.values(), key=lambda s: s.stage_id)
    scan_end = stages[0].finished if stages and stages[0].finished else None
    read = (scan_end - job_started) if scan_end is not None else None
    out = {
        "total_s": finished - started,
        "compute_s": computed - job_started,
        "report_s": finished - computed,
    }
    if read is not None and len(stages) >= 2:
        out["read_s"] = read
        out["reconcile_s"] = computed - scan_end  # type: ignore[operator]
    return out


class _NoProgress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def merge_histograms(stats: list[dict[str, Any]]) -> Histogram:
    hist = Histogram()
    for row in stats:
        if row.get("lat_count"):
            hist.merge(
                row["lat_hist"] or [0] * SIZE,
                row["lat_count"],
                row["lat_sum"],
                row["lat_min"],
                row["lat_max"],
            )
    return hist
