"""Each of the three memcached-binary listeners (the reference node, the TAP front,
the UPR front) started on a free loopback port with given users and limits, for
tests that hold every listener to the same rules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from adapters.mcbp import Magic, Opcode, encode_frame
from gateway.io.limits import ConnectionLimits, ListenerCounters
from gateway.metrics.figures import GatewayStats
from tests.support.tap_client import start_node

KINDS = ("node", "tap-front", "upr-front")


@dataclass
class Listener:
    kind: str
    port: int
    counters: ListenerCounters
    upstream_port: int


async def start_listener(
    nursery: trio.Nursery,
    kind: str,
    tmp_path: Path,
    *,
    users: Any = None,
    limits: ConnectionLimits | None = None,
    **config: Any,
) -> Listener:
    limits = limits or ConnectionLimits()
    if kind == "node":
        if limits.command_idle_timeout == ConnectionLimits().command_idle_timeout:
            # the node's own default: command connections may idle
            limits = ConnectionLimits(**{**limits.__dict__, "command_idle_timeout": None})
        node, port = await start_node(nursery, users=users, limits=limits, **config)
        return Listener(kind, port, node.listener_counters, port)
    _, node_port = await start_node(nursery)
    stats = GatewayStats()
    if kind == "tap-front":
        from tests.support.tapfront import start_front

        front, port = await start_front(nursery, node_port, users=users, limits=limits, **config)
        return Listener(kind, port, front.stats.listeners, node_port)
    from tests.gateway.fronts.upr.support import start_front as start_upr_front

    _, port, _ = await start_upr_front(
        nursery, tmp_path / "state", node_port, stats=stats, users=users, limits=limits, **config
    )
    return Listener(kind, port, stats.listeners, node_port)


def request(opcode: int, *, key: bytes = b"", value: bytes = b"", opaque: int = 1) -> bytes:
    return encode_frame(Magic.REQUEST, opcode, key=key, value=value, opaque=opaque)


def sasl(user: str, password: str, opaque: int = 1) -> bytes:
    token = b"\x00" + user.encode() + b"\x00" + password.encode()
    return request(Opcode.SASL_AUTH, key=b"PLAIN", value=token, opaque=opaque)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes (callers bound the time)."""
    received = b""
    while True:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return received  # closed with our bytes unread: a reset
        if not data:
            return received
        received += data
