"""Shutting a long-running command down on SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal

import trio

log = logging.getLogger(__name__)


async def stop_on_signal(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM (a clean shutdown)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            scope.cancel()
            return
