"""The start-up check of an upstream asks it a memcached VERSION, not only for a TCP
connect: an operator who points the gateway at a REST port, an HTTP proxy or a
TLS-only port reads why in one warning line and in ``/readyz``, instead of a
ready gateway whose every client connection fails.

The probe follows memcached's binary protocol (protocol_binary.h: magic 0x80
request, 0x81 response; PROTOCOL_BINARY_CMD_VERSION 0x0b), which ep-engine 2.x
and 3.0 nodes answer before SASL too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio

from gateway.cli import startup
from gateway.metrics.health import Health
from gateway.node.server import Node, NodeConfig
from gateway.node.store import Store

Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def serve(nursery: trio.Nursery, handler: Handler) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


def replying(data: bytes) -> Handler:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.receive_some(24)
        await stream.send_all(data)
        await stream.aclose()

    return handler


async def silent(stream: trio.SocketStream) -> None:
    await trio.sleep_forever()


async def hang_up(stream: trio.SocketStream) -> None:
    await stream.aclose()


async def first_verdict(port: int, caplog: pytest.LogCaptureFixture) -> tuple[bool, str, str]:
    health = Health()
    state = health.upstream("--upr-upstream", f"127.0.0.1:{port}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: startup.watch_upstream("--upr-upstream", ("127.0.0.1", port), health=state)
        )
        while state.reachable is None:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return bool(state.reachable), state.detail, warnings[0] if warnings else ""


@pytest.mark.parametrize(
    ("handler", "why"),
    [
        (replying(b"HTTP/1.1 400 Bad Request\r\n\r\n"), "speaks HTTP, not the memcached binary"),
        (replying(b"\x16\x03\x01\x00\x02\x02\x46"), "speaks TLS, not plain memcached"),
        (replying(b"+OK\r\n"), "does not speak the memcached binary protocol (first byte 0x2b)"),
        (hang_up, "closed the connection without answering a memcached VERSION"),
        (silent, "accepts connections but does not answer a memcached VERSION within"),
    ],
)
async def test_an_upstream_that_is_not_memcached_is_named_in_one_line(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    handler: Handler,
    why: str,
) -> None:
    monkeypatch.setattr(startup, "CHECK_TIMEOUT", 0.2)
    port = await serve(nursery, handler)
    with caplog.at_level(logging.WARNING, logger="gateway.cli.serve"):
        reachable, detail, line = await first_verdict(port, caplog)
    assert not reachable
    assert why in detail
    assert line.startswith(f"--upr-upstream 127.0.0.1:{port} is unreachable: {why}")
    assert "\n" not in line


async def test_a_reference_node_behind_sasl_answers_the_check(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(Store(n_vbuckets=4), NodeConfig(vbuckets=4, users={"replica": "secret"}))
    listeners = await nursery.start(node.serve, "127.0.0.1", 0)
    port = int(listeners[0].socket.getsockname()[1])
    reachable, detail, line = await first_verdict(port, caplog)
    assert (reachable, detail, line) == (True, "answers", "")
