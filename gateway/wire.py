"""Memcached-binary connections over trio: a frame reader and a batching writer.

One ``PacketConnection`` per socket. The owner reads with ``receive_frame``
(``None`` at a clean end of stream) and queues bytes with ``send``. A writer
task joins everything queued since its last write into one ``send_all``
(per-packet writes cost many times more in Python). The outbox is bounded in
bytes: ``send`` waits while more than ``max_outbox_bytes`` are queued, so a
slow peer pushes back on whoever produces for it.

``run_connection`` runs a handler with its writer in one nursery, flushes
what the handler queued when it returns, and closes the socket with a
shielded, time-limited cleanup. A ``ProtocolError`` from the handler is
logged with the peer's name and closes only that connection.

A listener's connections carry ``ConnectionLimits`` (``gateway.limits``): the
handler moves a connection from stage to stage (``authenticated``,
``streaming``) and the reader enforces each stage's frame size and time
limits before buffering a body; ``serve_packets`` refuses connections past
``max_connections``.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from adapters.errors import ProtocolError
from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE, HEADER_SIZE, Frame, FrameReader
from gateway import logs
from gateway.limits import NO_LIMITS, ConnectionLimits, ListenerCounters, Stage

if TYPE_CHECKING:
    from gateway.auth import Authenticator

log = logging.getLogger(__name__)

RECEIVE_SIZE = 256 * 1024
DEFAULT_MAX_OUTBOX_BYTES = 4 * 1024 * 1024
CLOSE_TIMEOUT = 2.0
FLUSH_TIMEOUT = 10.0
"""How long a closing connection may take to hand its last queued bytes to a slow peer."""


class ConnectionClosed(Exception):
    """The connection was closed while a send was waiting."""


class ConnectionTimeout(ProtocolError):
    """The peer took too long (to authenticate, to start streaming, to finish a frame)."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


class PacketConnection:
    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        name: str = "peer",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES,
        limits: ConnectionLimits | None = None,
        stage: Stage = Stage.STREAM,
        label: str = "",
        counters: ListenerCounters | None = None,
    ) -> None:
        self.stream = stream
        self.name = name
        self.limits = limits if limits is not None else NO_LIMITS.with_frame_size(max_frame_size)
        self.label = label
        self.counters = counters
        self.stage = stage
        self.reader = FrameReader(self.limits.frame_size(stage))
        self._accepted = trio.current_time()
        self._last_frame = self._accepted
        self._frame_started: float | None = None
        self.authority: Authenticator | None = None
        """Who authenticated on this connection (set by a listener's handler)."""
        self.max_outbox_bytes = max_outbox_bytes
        self._outbox: deque[bytes] = deque()
        self._outbox_bytes = 0
        self._has_data = trio.Event()
        self._has_room = trio.Event()
        self._has_room.set()
        self._closing = False
        self._writer_done = trio.Event()
        self.bytes_received = 0
        self.bytes_sent = 0
        self.peak_outbox_bytes = 0
        """The most bytes ever queued at once (what the outbox cost at its fullest)."""

    # -- stages ------------------------------------------------------------

    def authenticated(self) -> None:
        """SASL succeeded: command-sized frames, no authentication deadline."""
        if self.stage is Stage.AUTH:
            self._enter(Stage.COMMAND)

    def streaming(self) -> None:
        """The connection became a stream (or a plain command connection): full limits."""
        self._enter(Stage.STREAM)

    def _enter(self, stage: Stage) -> None:
        self.stage = stage
        self._last_frame = trio.current_time()
        self.reader.max_frame_size = self.limits.frame_size(stage)

    def _deadline(self) -> tuple[float, str, str]:
        """When the wait for the next bytes ends, why, and the kind (for the metrics)."""
        limits = self.limits
        deadline, why, kind = float("inf"), "", ""
        if self.stage is Stage.AUTH:
            deadline = self._accepted + limits.handshake_timeout
            why = f"no SASL authentication within {limits.handshake_timeout:g}s"
            kind = "handshake"
        elif self.stage is Stage.COMMAND and limits.command_idle_timeout is not None:
            deadline = self._last_frame + limits.command_idle_timeout
            why = f"idle for {limits.command_idle_timeout:g}s without a TAP CONNECT or UPR OPEN"
            kind = "idle"
        if self._frame_started is not None:
            body = self.reader.pending_body_length() or 0
            allowance = limits.frame_allowance(body)
            if self._frame_started + allowance < deadline:
                deadline = self._frame_started + allowance
                why = (
                    f"a frame not complete within {allowance:g}s "
                    f"({self.reader.buffered} bytes of it received)"
                )
                kind = "frame"
        return deadline, why, kind

    def _refused_frame(self, exc: ProtocolError) -> ProtocolError:
        """A frame over the stage's limit, said in the stage's words."""
        if self.stage is Stage.STREAM or exc.field != "total_body" or exc.value is None:
            return exc
        if exc.value <= self.reader.max_frame_size:
            return exc  # extras and key longer than the body: malformed, not too big
        if self.counters is not None:
            self.counters.frames_refused_total[self.label, self.stage.value] += 1
        before = "SASL authentication" if self.stage is Stage.AUTH else "TAP CONNECT / UPR OPEN"
        return ProtocolError(
            f"frames before {before} are limited to {self.reader.max_frame_size} bytes",
            opcode=exc.opcode,
            field="total_body",
            value=exc.value,
        )

    # -- reading -----------------------------------------------------------

    async def receive_frame(self) -> Frame | None:
        """The next frame; ``None`` once the peer closed cleanly between frames."""
        # Clocks restart per call: time the handler spends elsewhere is not the peer's.
        self._last_frame = trio.current_time()
        self._frame_started = None
        while True:
            try:
                frame = self.reader.next_frame()
            except ProtocolError as exc:
                raise self._refused_frame(exc) from None
            if frame is not None:
                return frame
            if self.reader.buffered and self._frame_started is None:
                self._frame_started = trio.current_time()
            deadline, why, kind = self._deadline()
            with trio.move_on_at(deadline) as waited:
                data = await self.stream.receive_some(self._receive_size())
            if waited.cancelled_caught:
                if self.counters is not None:
                    self.counters.timeouts_total[self.label, kind] += 1
                raise ConnectionTimeout(why, kind)
            if not data:
                if self.reader.buffered:
                    raise ProtocolError(
                        f"connection closed inside a packet ({self.reader.buffered} bytes "
                        "of it received)",
                        offset=self.reader.consumed,
                    )
                return None
            self.bytes_received += len(data)
            self.reader.receive_data(data)

    def _receive_size(self) -> int:
        """Before streaming, read no more than a frame may hold, so a peer that has not
        proved itself never makes us buffer a large chunk."""
        if self.stage is Stage.STREAM:
            return RECEIVE_SIZE
        return min(RECEIVE_SIZE, HEADER_SIZE + self.reader.max_frame_size)

    def next_buffered_frame(self) -> Frame | None:
        """A frame already received, without waiting for the network."""
        return self.reader.next_frame()

    # -- writing -----------------------------------------------------------

    @property
    def outbox_bytes(self) -> int:
        return self._outbox_bytes

    @property
    def outbox_room(self) -> int:
        """Bytes that may be queued before ``send`` waits (0: full)."""
        return max(0, self.max_outbox_bytes - self._outbox_bytes)

    async def wait_for_room(self) -> None:
        """Wait while the outbox is over its limit (or until the connection closes)."""
        while self._outbox_bytes >= self.max_outbox_bytes and not self._closing:
            await self._room_event().wait()

    async def send(self, data: bytes) -> None:
        """Queue ``data``; waits while the outbox is over its limit."""
        await self.wait_for_room()
        self.send_nowait(data)

    def send_nowait(self, data: bytes) -> None:
        """Queue ``data`` regardless of the limit (small control replies)."""
        if self._closing:
            raise ConnectionClosed(self.name)
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        if self._outbox_bytes > self.peak_outbox_bytes:
            self.peak_outbox_bytes = self._outbox_bytes
        self._has_data.set()

    async def drain(self) -> None:
        """Wait until everything queued so far has been handed to the socket."""
        while self._outbox_bytes and not self._writer_done.is_set():
            await self._room_event().wait()

    def _room_event(self) -> trio.Event:
        """The event the next write sets; shared by every waiter (one fresh per write),
        so a second waiter never strands the first on an event nobody will set."""
        if self._has_room.is_set():
            self._has_room = trio.Event()
        return self._has_room

    @property
    def writer_done(self) -> trio.Event:
        return self._writer_done

    async def run_writer(self) -> None:
        try:
            while True:
                if not self._outbox:
                    if self._closing:
                        return
                    self._has_data = trio.Event()
                    await self._has_data.wait()
                    continue
                batch = b"".join(self._outbox)
                self._outbox.clear()
                await self.stream.send_all(batch)
                self.bytes_sent += len(batch)
                self._outbox_bytes -= len(batch)
                self._has_room.set()
        finally:
            self._writer_done.set()
            self._has_room.set()

    def finish(self) -> None:
        """No more sends: the writer flushes what is queued, then stops."""
        self._closing = True
        self._has_data.set()
        self._has_room.set()


Handler = Callable[[PacketConnection], Awaitable[None]]


async def run_connection(
    stream: trio.abc.Stream,
    handler: Handler,
    *,
    name: str,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES,
    limits: ConnectionLimits | None = None,
    stage: Stage = Stage.STREAM,
    label: str = "",
    counters: ListenerCounters | None = None,
) -> None:
    """Serve one connection with ``handler``; never lets a peer's fault escape."""
    conn = PacketConnection(
        stream,
        name=name,
        max_frame_size=max_frame_size,
        max_outbox_bytes=max_outbox_bytes,
        limits=limits,
        stage=stage,
        label=label,
        counters=counters,
    )
    refused: ProtocolError | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.run_writer)
            try:
                await handler(conn)
            except ProtocolError as exc:
                # Kept out of the nursery so the writer still flushes the error
                # reply the handler queued before raising.
                refused = exc
            finally:
                conn.finish()
            with trio.move_on_after(FLUSH_TIMEOUT):
                await conn.writer_done.wait()
            nursery.cancel_scope.cancel()
        if refused is not None:
            log.warning("%s: closing connection: %s", name, refused)
    except* ProtocolError as group:
        log.warning("%s: closing connection: %s", name, _first(group))
    except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed) as group:
        log.info("%s: connection lost: %s", name, _first(group) or "closed")
    except* Exception as group:
        # A bug must cost this one connection, not the listener and its peers.
        log.error("%s: internal error, closing connection", name, exc_info=_first(group))
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            scope.shield = True
            await stream.aclose()


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The innermost first exception of a (possibly nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


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
