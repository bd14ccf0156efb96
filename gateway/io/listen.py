"""Listening: accept connections, refuse those past the limit, do TLS, serve each.

``serve_packets`` binds ``host:port``, hands each accepted socket (after its
TLS handshake, when the listener serves TLS) to ``run_connection`` in the
``AUTH`` or ``COMMAND`` stage, and refuses connections past
``max_connections`` at accept (logged at most once every ten seconds,
counted).
"""

from __future__ import annotations

import logging
import math
import ssl

import trio

from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE
from gateway.io.connection import (
    CLOSE_TIMEOUT,
    DEFAULT_MAX_OUTBOX_BYTES,
    Handler,
    run_connection,
)
from gateway.io.limits import ConnectionLimits, ListenerCounters, Stage
from gateway.runtime import logs

log = logging.getLogger(__name__)


def peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "peer"
    return f"{host}:{port}"


async def serve_packets(
    handler: Handler,
    host: str,
    port: int,
    *,
    label: str,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    limits: ConnectionLimits | None = None,
    auth_required: bool = False,
    counters: ListenerCounters | None = None,
    ssl_context: ssl.SSLContext | None = None,
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES,
) -> None:
    """Listen on ``host:port`` (0: any free port) and serve each connection.

    ``task_status.started`` receives the listeners, so callers learn the port.
    Connections start in the ``AUTH`` stage when ``auth_required``, else in
    ``COMMAND``; past ``limits.max_connections`` open ones, a new connection is
    closed at once, logged and counted. With ``ssl_context`` every connection
    is TLS (the handshake within the handshake timeout).
    """
    limits = (limits or ConnectionLimits()).with_frame_size(max_frame_size)
    counters = counters if counters is not None else ListenerCounters()
    stage = Stage.AUTH if auth_required else Stage.COMMAND
    refusals = _RefusalLog(label, limits.max_connections)

    async def on_connection(stream: trio.SocketStream) -> None:
        peer = peer_name(stream)
        if counters.open_connections[label] >= limits.max_connections:
            counters.refusals_total[label] += 1
            refusals.refused(peer)
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                scope.shield = True
                await stream.aclose()
            return
        counters.open_connections[label] += 1
        try:
            with logs.bind(listener=label, peer=peer):
                served: trio.abc.Stream = stream
                if ssl_context is not None:
                    secured = await _tls_handshake(stream, ssl_context, limits, peer, label)
                    if secured is None:
                        counters.timeouts_total[label, "tls"] += 1
                        return
                    served = secured
                await run_connection(
                    served,
                    handler,
                    name=f"{label} {peer}",
                    max_frame_size=max_frame_size,
                    max_outbox_bytes=max_outbox_bytes,
                    limits=limits,
                    stage=stage,
                    label=label,
                    counters=counters,
                )
        finally:
            counters.open_connections[label] -= 1

    listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        started = await nursery.start(trio.serve_listeners, on_connection, listeners)
        task_status.started(started)


class _RefusalLog:
    """One line per refused connection, at most one every ``interval`` seconds (a flood
    of connections must not flood the log); the lines say how many were refused since."""

    def __init__(self, label: str, limit: int, interval: float = 10.0) -> None:
        self.label, self.limit, self.interval = label, limit, interval
        self._last = -math.inf
        self._unlogged = 0

    def refused(self, peer: str) -> None:
        self._unlogged += 1
        now = trio.current_time()
        if now - self._last < self.interval:
            return
        log.warning(
            "%s: refused connection from %s: %d connections open (--max-connections); "
            "%d refused since the last such line",
            self.label,
            peer,
            self.limit,
            self._unlogged,
        )
        self._last, self._unlogged = now, 0


async def _tls_handshake(
    stream: trio.SocketStream,
    context: ssl.SSLContext,
    limits: ConnectionLimits,
    peer: str,
    label: str,
) -> trio.SSLStream[trio.SocketStream] | None:
    """The TLS side of ``stream``, or None (logged, closed) when the handshake fails."""
    secured = trio.SSLStream(stream, context, server_side=True)
    reason = ""
    with trio.move_on_after(min(limits.handshake_timeout, limits.frame_timeout * 3)) as scope:
        try:
            await secured.do_handshake()
            return secured
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__
            reason = str(getattr(cause, "reason", None) or cause or "connection lost")
    if scope.cancelled_caught:
        reason = "timed out"
    log.warning("%s %s: TLS handshake failed: %s", label, peer, reason)
    with trio.move_on_after(CLOSE_TIMEOUT) as closing:
        closing.shield = True
        await stream.aclose()
    return None


def bound_port(listeners: list[trio.SocketListener]) -> int:
    port: int = listeners[0].socket.getsockname()[1]
    return port


def parse_hostport(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``/``PORT``) to a pair, with a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad address {text!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"bad address {text!r}: port {number} out of range")
    return host, number
