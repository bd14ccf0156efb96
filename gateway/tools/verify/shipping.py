"""Ship the job's own code to Spark's executors, and pick their Python.

Executors run Python workers of their own; on a cluster (or from a venv, or
pipx) those need not have this package, so the job adds it to itself: a zip
of the installed ``adapters`` and ``gateway`` packages built at run time
(``SparkContext.addPyFile``), with msgpack's pure-Python modules under
``_tapupr_shipped`` for executors that lack msgpack (``segments`` falls back
to them; an installed msgpack still wins). The workers run the driver's own
interpreter unless the user chose one (``PYSPARK_PYTHON`` or
``spark.pyspark.python``), so the Python version matches.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

SHIPPED = "_tapupr_shipped"
ZIP_PREFIX = "tap-upr-gateway-job-"


def worker_python(conf: dict[str, str]) -> dict[str, str]:
    """``spark.pyspark.python`` for the executors, unless the user set one."""
    if os.environ.get("PYSPARK_PYTHON") or "spark.pyspark.python" in conf:
        return {}
    return {"spark.pyspark.python": sys.executable}


def _add_tree(archive: zipfile.ZipFile, root: Path, under: str) -> None:
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            archive.write(path, f"{under}/{path.relative_to(root).as_posix()}")


def build_job_zip(directory: Path) -> Path:
    """A zip of this package's code (and msgpack's Python modules) in ``directory``."""
    import msgpack

    import adapters
    import gateway

    fd, name = tempfile.mkstemp(prefix=ZIP_PREFIX, suffix=".zip", dir=directory)
    os.close(fd)
    path = Path(name)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in (adapters, gateway):
            root = Path(package.__file__ or "").parent
            _add_tree(archive, root, package.__name__)
        archive.writestr(f"{SHIPPED}/__init__.py", '"""Modules shipped with the verify job."""\n')
        _add_tree(archive, Path(msgpack.__file__ or "").parent, f"{SHIPPED}/msgpack")
    return path


def ship(spark: Any) -> Path:
    """Add the job's code to ``spark``'s context; the zip is removed when Python exits."""
    import atexit

    path = build_job_zip(Path(tempfile.gettempdir()))
    atexit.register(path.unlink, missing_ok=True)
    spark.sparkContext.addPyFile(str(path))
    return path
