"""Shutting a long-running command down on SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

log = logging.getLogger(__name__)


@asynccontextmanager
async def stopped_by_signals() -> AsyncIterator[trio.CancelScope]:
    """A cancel scope the first SIGINT or SIGTERM cancels, for a body that saves its
    state on the way out.

    The signals stay caught until the body has finished: a second Ctrl-C while it
    shuts down is logged and ignored, where trio's default would raise
    KeyboardInterrupt in the middle of the state being saved (and print a traceback).
    """
    scope = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as watcher:
            watcher.start_soon(_watch, signals, scope)
            try:
                yield scope
            finally:
                watcher.cancel_scope.cancel()


async def _watch(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if scope.cancel_called:
            log.info("received %s again: already shutting down (saving state)", name)
        else:
            log.info("received %s, shutting down", name)
            scope.cancel()
