"""verify's errors before Spark starts: the real command in a subprocess, one line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.tools.verify.synthetic import history, write_capture
from tests.support.pythons import python_without

ROOT = Path(__file__).resolve().parents[4]


def _verify(
    *args: str, python: str = sys.executable, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [python, "-m", "gateway", "verify", *args, "--no-progress"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def _pair(tmp: Path) -> tuple[str, str]:
    records = list(history(2, 20))
    write_capture(tmp / "left", records)
    write_capture(tmp / "right", records)
    return str(tmp / "left"), str(tmp / "right")


def test_foreign_files_are_named_before_spark_starts(tmp_path: Path) -> None:
    left, _ = _pair(tmp_path)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "a.tucap").write_bytes(b"\x00garbage" * 100)
    done = _verify(left, str(garbage))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("verify: RIGHT: ") and str(garbage / "a.tucap") in done.stderr
    assert "not a capture segment" in done.stderr and done.stdout == ""


def test_without_the_pipeline_extra_one_line_names_it(tmp_path: Path) -> None:
    left, right = _pair(tmp_path)
    python = python_without(tmp_path, "pyarrow", "pyspark", "pandas", "__editable__")
    done = _verify(left, right, python=str(python))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "pip install 'tap-upr-gateway[pipeline]'" in done.stderr
    assert "Java 17" in done.stderr and "Traceback" not in done.stderr


def test_without_java_one_line_says_so(tmp_path: Path) -> None:
    left, right = _pair(tmp_path)
    empty = tmp_path / "bin"
    empty.mkdir()
    done = _verify(left, right, PATH=str(empty), JAVA_HOME="")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "verify: no java on PATH and no JAVA_HOME; Spark needs Java 17 or newer"
    )
    done = _verify(left, right, JAVA_HOME=str(tmp_path))
    assert done.returncode == 2 and f"JAVA_HOME={tmp_path} has no bin/java" in done.stderr


def test_a_report_path_that_cannot_be_written_is_named_before_spark_starts(
    tmp_path: Path,
) -> None:
    left, right = _pair(tmp_path)
    nowhere = tmp_path / "no-such-dir" / "report.html"
    done = _verify(left, right, "--html", str(nowhere))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"verify: --html {nowhere}: no such directory {nowhere.parent}\n"), (
        done.stderr
    )
    done = _verify(left, right, "--report", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr == f"verify: --report {tmp_path}: is a directory, not a file\n"
