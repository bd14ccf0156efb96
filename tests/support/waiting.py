"""Waiting on conditions, never on time: the one helper the tests share for it."""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until ``condition`` holds (callers bound the time)."""
    while not condition():
        await trio.testing.wait_all_tasks_blocked(0.001)
