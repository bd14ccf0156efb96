"""How long the trio loop went without running a ready task, and what the GC took.

Every connection shares one thread: a task step that runs long (a big batch,
a disk read, a full garbage collection) delays every other connection by as
much. ``LoopWatch.run`` sleeps ``interval`` seconds at a time and records by
how much each wake-up came late (the loop's largest stall, GC included);
a ``gc.callbacks`` hook records each collection's pause. ``serve`` logs both
on the way out.

``freeze_startup_objects``: after start-up, the modules, settings and logs
opened stay alive for the whole run; ``gc.freeze`` moves them out of the
collector's generations so the full collections that per-item garbage
triggers no longer walk them again and again; and the thresholds
(``GC_THRESHOLDS``) let a young collection come every 10,000 allocations
instead of 700, so per-item tuples mostly die before one and far fewer are
promoted into the older generations whose collections stall the loop (at
50,000, a 400,000-item UPR front run: GC from 667 ms in all, largest pause 80 ms, to
62 ms, largest pause 9 ms). At 50,000 a young collection of a live UPR
stream at 20k items/s paused the loop 13-20 ms, a p99 of its own; 10,000
makes the pauses 3-5 ms for the same GC time in all (added p99 at 20k/s
+22 to +29 ms and one +305 ms against +15 to +22 ms, four alternating
runs each; the bulk rows and the TAP front's live rows unchanged).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import trio

DEFAULT_INTERVAL = 0.01
GC_THRESHOLDS = (10_000, 20, 100)


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections;
    how many objects were frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_freeze_count()


class LoopWatch:
    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        self.interval = interval
        self.largest_stall = 0.0
        """Seconds the latest wake-up of ``run`` came after its deadline, at most."""
        self.largest_gc_pause = 0.0
        self.gc_seconds = 0.0
        self.collections = 0
        self.largest_gc_generation = 0
        """The generation the longest collection was of (2: a full one)."""
        self.by_generation = [0, 0, 0]
        """Collections of each generation."""
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_started
        generation = int(info.get("generation", 0))
        self.collections += 1
        self.by_generation[min(generation, 2)] += 1
        self.gc_seconds += pause
        if pause > self.largest_gc_pause:
            self.largest_gc_pause = pause
            self.largest_gc_generation = generation

    async def run(self) -> None:
        """Measure until cancelled."""
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                due = time.perf_counter() + self.interval
                await trio.sleep(self.interval)
                late = time.perf_counter() - due
                if late > self.largest_stall:
                    self.largest_stall = late
        finally:
            gc.callbacks.remove(self._on_gc)

    def summary(self) -> str:
        return (
            f"trio loop: largest stall {self.largest_stall * 1e3:.1f} ms; "
            f"garbage collector: {self.collections} collections "
            f"(by generation {'/'.join(map(str, self.by_generation))}), "
            f"{self.gc_seconds * 1e3:.0f} ms in all, largest pause "
            f"{self.largest_gc_pause * 1e3:.1f} ms (generation {self.largest_gc_generation})"
        )
