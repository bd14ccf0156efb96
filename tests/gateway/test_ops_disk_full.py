"""A full disk while serving, as the operator sees it: a real ``serve`` whose log
writes hit a file size limit (``RLIMIT_FSIZE``; Python ignores SIGXFSZ, so the
kernel's answer is EFBIG, as ENOSPC is for a full disk).

The operator gets one error line naming the vbucket's log file and the reason,
``tapupr_upr_front_log_write_failures_total{errno}`` counts it, ``/readyz``
answers 503 with the same words until a write goes through again. That
nothing unwritten is acknowledged to the TAP upstream is pinned by
``tests/gateway/fronts/upr/test_log_write_limit.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.children import stop

GATEWAY = [sys.executable, "-m", "gateway"]
LIMIT = 48 * 1024
"""Bytes a file may grow to in the gateway: a few dozen 1 KB items per segment."""
DEADLINE = 60.0


class Lines:
    """A process's stderr, read by a thread; ``wait`` for a line matching a pattern."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of the stream
            self.changed.notify_all()

    def wait(self, pattern: str) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def seen() -> bool:
            found[:] = [m for line in self.lines if (m := re.search(pattern, line))][:1]
            return bool(found) or (bool(self.lines) and self.lines[-1] == "")

        with self.changed:
            assert self.changed.wait_for(seen, timeout=DEADLINE), "".join(self.lines)[-2000:]
        assert found, (pattern, "".join(self.lines)[-2000:])
        return found[0]


@contextmanager
def running(
    args: list[str], limit: int | None = None
) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    def limited() -> None:
        if limit is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

    process = subprocess.Popen(
        [*GATEWAY, *args], stderr=subprocess.PIPE, text=True, preexec_fn=limited
    )
    try:
        yield process, Lines(process)
    finally:
        stop(process)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def until_ready(port: int, wanted: int) -> dict[str, object]:
    """Poll ``/readyz`` until it answers ``wanted``."""
    deadline = time.monotonic() + DEADLINE
    while True:
        status, body = get(port, "/readyz")
        if status == wanted:
            doc: dict[str, object] = json.loads(body)
            return doc
        assert time.monotonic() < deadline, (status, body)
        threading.Event().wait(0.05)


def failures(port: int) -> dict[str, int]:
    _, text = get(port, "/metrics")
    pattern = r'^tapupr_upr_front_log_write_failures_total\{errno="(\w+)"\} (\d+)'
    return {m[1]: int(m[2]) for m in re.finditer(pattern, text, re.M)}


def load(node: int, prefix: str) -> None:
    done = subprocess.run(
        [*GATEWAY, "load", "--target", f"127.0.0.1:{node}", "--items", "300",
         "--value-size", "1000", "--prefix", prefix],
        capture_output=True, text=True, timeout=DEADLINE,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux)")
def test_a_full_disk_is_one_line_a_metric_and_a_reason_not_to_be_ready(tmp_path: Path) -> None:
    node_args = ["node", "--listen", "127.0.0.1:0", "--vbucket-count", "4"]
    with running(node_args) as (_, node_log):
        node = int(node_log.wait(r"listening on 127\.0\.0\.1:(\d+)")[1])
        serve_args = [
            "serve", "--tap-upstream", f"127.0.0.1:{node}", "--upr-listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
        ]  # fmt: skip
        with running(serve_args, limit=LIMIT) as (serve, lines):
            metrics = int(lines.wait(r"metrics on http://127\.0\.0\.1:(\d+)/")[1])
            until_ready(metrics, 200)
            assert failures(metrics) == {"EDQUOT": 0, "EFBIG": 0, "EIO": 0, "ENOSPC": 0}
            load(node, "full")  # more than the limit lets a vbucket's segment hold
            line = lines.wait(r"ERROR .*cannot append.*").group(0)
            assert re.search(r"vbucket \d+: cannot append \d+ bytes to vb-\d{4}/\S+: ", line)
            assert "File too large; cut back to its last whole record" in line
            assert "nothing acknowledged" in line
            doc = until_ready(metrics, 503)
            (reason,) = doc["not_ready"]  # type: ignore[misc]
            assert reason.startswith("the UPR front cannot write its log: vbucket ")
            assert "File too large" in reason
            assert failures(metrics)["EFBIG"] >= 1, str(failures(metrics))

            # Room again: the held records are written and readiness comes back.
            resource.prlimit(serve.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            until_ready(metrics, 200)
            assert "Traceback" not in "".join(lines.lines)


def test_the_errno_comes_from_the_cause_else_from_the_message() -> None:
    from gateway.fronts.upr.segment_file import LogWriteError
    from gateway.runtime.write_failures import errno_name

    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as full:
            raise LogWriteError("vbucket 1: cannot append 9 bytes to vb-0001/x") from full
    except LogWriteError as failure:
        assert errno_name(failure) == "ENOSPC"
    # Re-raised out of a task group "from None": only the message tells.
    told = LogWriteError(
        f"vbucket 1: cannot append 9 bytes to vb-0001/x: {os.strerror(errno.EDQUOT)}; cut"
    )
    assert errno_name(told) == "EDQUOT"
    assert errno_name(LogWriteError("vbucket 1: an fsync overlapped one that failed")) == "unknown"


def test_not_ready_from_the_failure_until_the_log_grows() -> None:
    from gateway.metrics.figures import UprLogStats
    from gateway.metrics.health import Health

    upr_log = UprLogStats(bytes_on_disk=1000)
    health = Health(listeners_bound=True, logs_proven=True, upr_log=upr_log)
    assert health.problems() == []
    upr_log.note_write_failure("ENOSPC", "vbucket 2: cannot append: No space left on device")
    assert health.problems() == [
        "the UPR front cannot write its log: vbucket 2: cannot append: No space left on device"
    ]
    upr_log.bytes_on_disk = 900  # a compaction: still nothing written
    assert health.problems() != []
    upr_log.bytes_on_disk = 1100  # a write went through
    assert health.problems() == []
    assert upr_log.write_failures_total == {"ENOSPC": 1}
