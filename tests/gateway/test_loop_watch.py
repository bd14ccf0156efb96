"""The loop watch records a task step that blocks the loop, and garbage collections."""

from __future__ import annotations

import gc
import time

import trio

from gateway.runtime.loop_watch import GC_THRESHOLDS, LoopWatch, freeze_startup_objects

BLOCK = 0.05


async def test_a_blocking_step_is_the_largest_stall_and_collections_are_counted() -> None:
    watch = LoopWatch(interval=0.001)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(0.01)  # the watch is asleep on its deadline
        time.sleep(BLOCK)  # a step that never yields: every other task waits
        gc.collect()
        await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    # The watch woke at least BLOCK after its deadline (a lower bound, not a timing).
    assert watch.largest_stall >= BLOCK - watch.interval
    assert watch.collections >= 1 and watch.largest_gc_pause > 0
    assert watch._on_gc not in gc.callbacks  # unhooked when cancelled
    assert watch.summary().startswith("trio loop: largest stall ")


def test_freezing_moves_live_objects_out_of_the_generations() -> None:
    thresholds = gc.get_threshold()
    try:
        assert freeze_startup_objects() > 0
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == GC_THRESHOLDS
    finally:
        gc.unfreeze()  # the test process keeps its collector as it was
        gc.set_threshold(*thresholds)
