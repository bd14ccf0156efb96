"""``/healthz`` and ``/readyz`` on the metrics port of a real ``serve``
(gateway/metrics/health.py, gateway/cli/startup.py ``watch_upstream``).

Ready means every listener bound, every upstream answering its latest check
and the UPR front's logs proven; a 503 names what is not, one sentence each,
with the option and the address. The watch keeps checking, so readiness
follows the upstream both ways.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from gateway.cli import startup
from gateway.cli.serve import ServeOptions, run_serve
from gateway.metrics.health import Health
from gateway.node.server import Node, NodeConfig
from tests.gateway.serve.test_serve import http_get
from tests.support.tapfront import filled_store

ANY_PORT = ("127.0.0.1", 0)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def ready(port: int) -> tuple[int, dict[str, Any]]:
    status, body = await http_get(port, "/readyz")
    return status, json.loads(body)


async def ready_until(port: int, wanted: int) -> dict[str, Any]:
    """Poll ``/readyz`` until it answers ``wanted`` (the caller bounds the time)."""
    while True:
        status, doc = await ready(port)
        if status == wanted:
            return doc
        await trio.sleep(0.05)


async def test_readyz_follows_the_upstream_down_and_up(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup, "WATCH_INTERVAL", 0.1)
    dead = closed_port()
    options = ServeOptions(
        tap_listen=ANY_PORT, upr_upstream=("127.0.0.1", dead), metrics_listen=ANY_PORT
    )
    running = await nursery.start(run_serve, options)
    metrics = running.metrics_port
    with trio.fail_after(30):
        status, alive = await http_get(metrics, "/healthz")
        assert status == 200 and json.loads(alive)["alive"] is True
        doc = await ready_until(metrics, 503)
        while doc["upstreams"][0]["reachable"] is None:  # the first check is under way
            await trio.sleep(0.05)
            doc = (await ready(metrics))[1]
        assert doc["ready"] is False
        assert doc["not_ready"] == [
            f"--upr-upstream 127.0.0.1:{dead} is unreachable: "
            "connection refused (nothing listens there)"
        ]
        assert doc["listeners_bound"] is True and doc["logs_proven"] is None

        node = Node(filled_store(), NodeConfig(vbuckets=4))
        async with trio.open_nursery() as node_nursery:
            await node_nursery.start(node.serve, "127.0.0.1", dead)
            doc = await ready_until(metrics, 200)
            assert doc["ready"] is True and doc["not_ready"] == []
            assert doc["upstreams"][0]["detail"] == "answers"
            node_nursery.cancel_scope.cancel()
        doc = await ready_until(metrics, 503)
        assert "is unreachable" in doc["not_ready"][0]


async def test_ready_with_both_fronts_and_proven_logs(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    options = ServeOptions(
        tap_listen=ANY_PORT, upr_listen=ANY_PORT, metrics_listen=ANY_PORT, state_dir=tmp_path,
        embedded_vbuckets=4, embedded_sample_items=50, embedded_writes_per_second=0,
    )  # fmt: skip
    running = await nursery.start(run_serve, options)
    with trio.fail_after(30):
        doc = await ready_until(running.metrics_port, 200)
    assert doc["logs_proven"] is True and doc["logs_set_aside"] == 0
    assert [u["option"] for u in doc["upstreams"]] == ["embedded node"]


def test_not_ready_reasons_one_sentence_each() -> None:
    health = Health()
    health.logs_proven = False
    upstream = health.upstream("--tap-upstream", "node1:11210")
    assert health.problems() == [
        "listeners are still being bound",
        "--tap-upstream node1:11210 not checked yet",
        "the UPR front is still proving its logs",
    ]
    health.listeners_bound, health.logs_proven = True, True
    upstream.record(False, "timed out", now=10.0)
    assert health.problems() == ["--tap-upstream node1:11210 is unreachable: timed out"]
    upstream.record(False, "host unreachable", now=20.0)
    assert upstream.since == 10.0  # the state did not change
    upstream.record(True, "answers", now=30.0)
    assert health.problems() == [] and upstream.since == 30.0
    assert health.readiness()["ready"] is True


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 1e6, allow_nan=False)), max_size=30))
def test_upstream_health_since_marks_the_last_change(checks: list[tuple[bool, float]]) -> None:
    health = Health(listeners_bound=True)
    upstream = health.upstream("--upr-upstream", "node3:11210")
    state: bool | None = None
    since = upstream.since
    now = 0.0
    for reachable, step in checks:
        now += step
        upstream.record(reachable, "answers" if reachable else "timed out", now=now)
        if reachable != state:
            state, since = reachable, now
        assert (upstream.reachable, upstream.since, upstream.checked) == (state, since, now)
        assert health.readiness()["ready"] is reachable
        assert len(health.problems()) == (0 if reachable else 1)
