"""verify on a real standalone Spark cluster whose executors lack this package.

A master and two workers started from pyspark's own ``bin/spark-class`` on
127.0.0.1; the executors' Python sees the site-packages (pyarrow, pandas)
but neither this package nor msgpack, so the job works only if it ships its
own code (``gateway.tools.verify.shipping``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.tools.verify.synthetic import history, write_capture
from tests.support.pythons import python_without

ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.slow


def _spark_home() -> Path:
    pyspark = pytest.importorskip("pyspark")
    return Path(pyspark.__file__).parent


def _without_pythonpath() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME"):
        env.pop(name, None)
    return env


def _bare_python(tmp: Path) -> Path:
    """An interpreter with the site-packages minus this package and msgpack."""
    wrapper = python_without(tmp, "msgpack", "__editable__", "tap_upr")
    for module in ("gateway", "msgpack"):
        probe = subprocess.run(
            [str(wrapper), "-c", f"import pyarrow, {module}"],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp,
            env=_without_pythonpath(),
        )
        assert f"No module named '{module}'" in probe.stderr, probe.stderr
    return wrapper


def _wait_for(log: Path, pattern: str, process: subprocess.Popen[bytes]) -> re.Match[str]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"{log.name} exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} never appeared in {log}: {log.read_text()[-2000:]}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    home = _spark_home()
    # The workers (and so the executors) see no PYTHONPATH that leads to this package.
    env = {**_without_pythonpath(), "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1"}
    spark_class = str(home / "bin" / "spark-class")
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [spark_class, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
            )
        started.append(process)
        return process, log

    try:
        master, master_log = start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--webui-port",
            "0",
        )
        url = _wait_for(master_log, r"spark://127\.0\.0\.1:\d+", master).group(0)
        for n in range(2):
            worker, log = start(
                f"worker{n}",
                "org.apache.spark.deploy.worker.Worker",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                "0",
                "--work-dir",
                str(tmp_path / f"work{n}"),
            )
            _wait_for(log, "Successfully registered with master", worker)
        yield url
    finally:
        for process in reversed(started):
            process.terminate()
        for process in started:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_verify_on_a_standalone_cluster_whose_executors_lack_the_package(
    cluster: str, tmp_path: Path
) -> None:
    records = list(history(4, 300, seed=3))
    write_capture(tmp_path / "left", records, side="upr", connection="left")
    write_capture(tmp_path / "right", records, side="upr", connection="right")
    worker_python = _bare_python(tmp_path)
    env = {**_without_pythonpath(), "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "gateway.tools.verify",
        str(tmp_path / "left"),
        str(tmp_path / "right"),
        "--master",
        cluster,
        "--no-progress",
        "--driver-memory",
        "1g",
        "--report",
        str(tmp_path / "report.json"),
        "--conf",
        f"spark.pyspark.python={worker_python}",
        "--conf",
        "spark.executor.memory=512m",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.driver.bindAddress=127.0.0.1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("AGREE"), done.stdout
    assert f"on {cluster}" in done.stdout
    assert "Traceback" not in done.stderr
