"""The listeners' guards in /metrics: refusals past --max-connections, timeouts,
refused frames, failed SASL attempts and refused admin commands, by listener."""

from __future__ import annotations

from pathlib import Path

import trio
from prometheus_client import CollectorRegistry

from adapters.mcbp import Opcode
from gateway.io.connection import PacketConnection
from gateway.io.limits import ConnectionLimits
from gateway.metrics import register_gateway_metrics
from gateway.metrics.figures import GatewayStats
from tests.gateway.listeners import read_until_closed, sasl
from tests.gateway.metrics.conftest import Clock, scrape, value
from tests.support.tap_client import start_node
from tests.support.tapfront import start_front


def test_an_idle_gateway_reports_zero_for_each_front(
    stats: GatewayStats, registry: CollectorRegistry, clock: Clock
) -> None:
    register_gateway_metrics(registry, stats, clock=clock)
    s = scrape(registry)
    for listener in ("tap-front", "upr-front"):
        assert value(s, "tapupr_listener_refusals_total", listener=listener) == 0
        assert value(s, "tapupr_listener_open_connections", listener=listener) == 0
        assert value(s, "tapupr_sasl_failures_total", listener=listener) == 0
        assert value(s, "tapupr_admin_refusals_total", listener=listener) == 0


async def test_refusals_and_failed_logins_of_a_real_front_are_scraped(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, node_port = await start_node(nursery)
    limits = ConnectionLimits(max_connections=1, auth_failure_delay=0.01, max_auth_failures=1)
    front, port = await start_front(nursery, node_port, users={"a": "b"}, limits=limits)
    registry = CollectorRegistry(auto_describe=True)
    register_gateway_metrics(registry, front.stats, clock=Clock())
    with trio.fail_after(20):
        held = await PacketConnection.connect("127.0.0.1", port)
        await held.request(Opcode.NOOP)
        refused = await trio.open_tcp_stream("127.0.0.1", port)
        assert await read_until_closed(refused) == b""
        await refused.aclose()
        await held.send(sasl("a", "wrong"))
        assert await read_until_closed(held.stream)
        await held.aclose()
    s = scrape(registry)
    assert value(s, "tapupr_listener_refusals_total", listener="tap-front") == 1
    assert value(s, "tapupr_sasl_failures_total", listener="tap-front") == 1
