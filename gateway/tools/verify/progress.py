"""Progress of a running Spark job on stderr, from a thread polling the status tracker.

It also times stages (first seen running, seen finished) so the job can
split wall time between reading captures (the scan stage) and the
reconciliation (the stage after the shuffle), and samples the driver's
memory: the JVM's peak resident size (``VmHWM``; in local mode the JVM runs
the executors too) and this Python process's.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TextIO

POLL_SECONDS = 0.25


@dataclass
class StageTiming:
    stage_id: int
    name: str
    tasks: int
    first_seen: float
    finished: float | None = None


@dataclass
class ProgressLog:
    stages: dict[int, StageTiming] = field(default_factory=dict)
    jvm_peak_rss: int = 0
    jvm_heap_peak: int = 0

    def python_peak_rss(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class Progress:
    """``with Progress(spark, log):`` around the actions to watch."""

    def __init__(self, spark: Any, log: ProgressLog, *, stream: TextIO | None = None) -> None:
        self.spark = spark
        self.log = log
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verify-progress", daemon=True)
        self._last_line = ""
        self._last_print = 0.0
        jvm = spark.sparkContext._jvm
        self._runtime = jvm.java.lang.Runtime.getRuntime()
        self._pid = int(jvm.java.lang.ProcessHandle.current().pid())

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(5)
        self._poll()
        if self.tty and self._last_line:
            self.stream.write("\r" + " " * len(self._last_line) + "\r")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._poll()
            except Exception:  # the gateway to the JVM is closing: nothing more to show
                return

    def _poll(self) -> None:
        now = time.monotonic()
        log = self.log
        tracker = self.spark.sparkContext.statusTracker()
        active = set(tracker.getActiveStageIds())
        parts = []
        for stage_id in sorted(active):
            info = tracker.getStageInfo(stage_id)
            if info is None:
                continue
            timing = log.stages.get(stage_id)
            if timing is None:
                timing = log.stages[stage_id] = StageTiming(
                    stage_id, str(info.name).split(" at ")[0], info.numTasks, now
                )
            parts.append(
                f"stage {stage_id} ({timing.name}): {info.numCompletedTasks}/{info.numTasks} tasks"
                + (f", {info.numActiveTasks} running" if info.numActiveTasks else "")
            )
        for timing in log.stages.values():
            if timing.finished is None and timing.stage_id not in active:
                timing.finished = now
        log.jvm_peak_rss = max(log.jvm_peak_rss, _vm_hwm(self._pid))
        used = int(self._runtime.totalMemory()) - int(self._runtime.freeMemory())
        log.jvm_heap_peak = max(log.jvm_heap_peak, used)
        if not parts:
            return
        line = "verify: " + "; ".join(parts)
        if self.tty:
            padding = " " * max(0, len(self._last_line) - len(line))
            self.stream.write("\r" + line + padding)
            self.stream.flush()
        elif line != self._last_line and now - self._last_print >= 2.0:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_print = now
        self._last_line = line
