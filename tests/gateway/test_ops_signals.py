"""Ctrl-C and SIGTERM while a command saves its state on the way out.

The first signal cancels the work; a second one during the shutdown is logged
and ignored. Without that, trio's default turned it into a KeyboardInterrupt in
the middle of the state being saved, with a traceback on the terminal.
"""

from __future__ import annotations

import logging
import signal

import pytest
import trio

from gateway.runtime.signals import stopped_by_signals


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    with trio.fail_after(10):
        while not any(text in message for message in caplog.messages):
            await trio.sleep(0.01)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
async def test_a_second_signal_during_shutdown_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture, second: signal.Signals
) -> None:
    saved = False
    with caplog.at_level(logging.INFO, logger="gateway.runtime.signals"):
        async with stopped_by_signals() as stop:
            with stop:
                signal.raise_signal(signal.SIGINT)
                await trio.sleep_forever()  # until the first signal cancels it
            assert stop.cancelled_caught
            with trio.CancelScope(shield=True):  # saving state, as the fronts do
                signal.raise_signal(second)
                await logged(caplog, f"received {second.name} again: already shutting down")
                saved = True
    assert saved
    assert "received SIGINT, shutting down" in caplog.messages
