"""One local SparkSession for every Spark test of the verify job (JVM start-up is slow)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from gateway.tools.verify.job import spark_session

    session = spark_session(
        "local[2]",
        app_name="verify tests",
        driver_memory="1g",
        shuffle_partitions=4,
        conf={"spark.sql.session.timeZone": "UTC", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()
