"""Giving freed memory back to the operating system once connections close.

glibc's malloc keeps the heap it grew for a burst (a stalled consumer's
batches and outbox) after Python frees it, so RSS would stay at its peak.
``TrimAfterCloses`` coalesces the closes of a burst: one ``malloc_trim(0)``
a second after the last of them, not one per connection, after a full
garbage collection: a closed connection's tasks leave reference cycles
(cancelled tasks' tracebacks hold their frames, and with them any batch a
stream was sending), which would otherwise be freed only after the trim.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

COALESCE_SECONDS = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the allocator's free heap to the system; whether anything was done."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class TrimAfterCloses:
    def __init__(self, delay: float = COALESCE_SECONDS) -> None:
        self.delay = delay
        self._closed = trio.Event()
        self.trims = 0

    def connection_closed(self) -> None:
        self._closed.set()

    async def run(self) -> None:
        while True:
            await self._closed.wait()
            # Wait for the burst to end: every close meanwhile restarts the delay.
            while self._closed.is_set():
                self._closed = trio.Event()
                with trio.move_on_after(self.delay):
                    await self._closed.wait()
            gc.collect()  # the closed connections' cycles: freed before the trim
            if release_free_memory():
                self.trims += 1
