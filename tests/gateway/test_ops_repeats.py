"""A failure that repeats for hours (an upstream down) is one warning, then one a
minute with how many were quieter, not a warning per retry; each names the reason
an operator can act on ("connection refused"), not trio's "all attempts failed"."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from gateway.fronts.upr.config import UprFrontConfig
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.metrics.figures import GatewayStats
from gateway.runtime.logs import Repeats


@given(st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 30)), max_size=60))
def test_warnings_come_on_change_or_once_per_period(events: list[tuple[str, float]]) -> None:
    now = 0.0
    repeats = Repeats(every=60.0, clock=lambda: now)
    last_warned: tuple[str, float] | None = None
    quiet = 0
    for key, step in events:
        now += step
        level, note = repeats.level(key)
        due = last_warned is None or key != last_warned[0] or now - last_warned[1] >= 60.0
        assert (level == logging.WARNING) == due
        if due:
            assert note == (f" ({quiet} more since, at debug level)" if quiet else "")
            last_warned, quiet = (key, now), 0
        else:
            assert note == ""
            quiet += 1


def test_reset_makes_the_next_failure_news() -> None:
    repeats = Repeats(every=60.0, clock=lambda: 0.0)
    assert repeats.level("down")[0] == logging.WARNING
    assert repeats.level("down")[0] == logging.DEBUG
    repeats.reset()
    assert repeats.level("down") == (logging.WARNING, "")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_an_unreachable_tap_upstream_warns_once_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = closed_port()
    config = UprFrontConfig(
        ("127.0.0.1", 0), ("127.0.0.1", port), tmp_path, reconnect_min=0.001, reconnect_max=0.001
    )
    logs = LogSet(tmp_path, LogOptions(), GatewayStats(), seed=1)
    ingest = Ingest(config, logs, GatewayStats(), vbuckets=(0,))
    with caplog.at_level(logging.DEBUG, logger="gateway.fronts.upr.ingest"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ingest.run)
            with trio.fail_after(30):
                while sum("reconnecting in" in m for m in caplog.messages) < 20:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    retries = [r for r in caplog.records if "reconnecting in" in r.getMessage()]
    warned = [r.getMessage() for r in retries if r.levelno == logging.WARNING]
    assert len(warned) == 1  # the rest at debug level, within the minute
    assert warned[0].startswith(
        f"upstream 127.0.0.1:{port}: connection refused (nothing listens there); reconnecting in"
    )
    assert ingest.last_error == "connection refused (nothing listens there)"


async def test_a_tap_client_whose_upstream_is_gone_warns_once_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The TAP front's session retries a lost UPR upstream with backoff for as
    long as its client stays; each retry after the first warning is at debug level."""
    from tests.support.tap_client import TapClient, connect_event, start_node
    from tests.support.tapfront import start_front

    with caplog.at_level(logging.DEBUG, logger="gateway.fronts.tap.session"):
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as node_scope:
                async with trio.open_nursery() as node_nursery:
                    _, node_port = await start_node(node_nursery)
                    front, port = await start_front(nursery, node_port)
                    client = await TapClient.open(port, connect_event(b"repeats"))
                    with trio.fail_after(30):
                        while front.sessions.get("repeats") is None:
                            await trio.sleep(0.01)
                    node_scope.cancel()  # the upstream goes away for good
            with trio.fail_after(30):
                while sum("cannot connect" in m for m in caplog.messages) < 4:
                    await trio.sleep(0.01)
            await client.aclose()
            nursery.cancel_scope.cancel()
    # The loss itself, then the failed connects: the first of those is news (a new
    # reason, named as an operator can act on it), the ones that repeat it are not.
    refused = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert [r.levelno for r in refused[:4]] == [logging.WARNING] + [logging.DEBUG] * 3
    assert all(r.getMessage().startswith("repeats: ") for r in refused)
    assert "connection refused (nothing listens there); reconnecting in" in refused[0].getMessage()
    assert "all attempts" not in refused[0].getMessage()
