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
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from adapters.errors import ProtocolError
from adapters.mcbp import DEFAULT_MAX_FRAME_SIZE, Frame, FrameReader
from gateway import logs

log = logging.getLogger(__name__)

RECEIVE_SIZE = 256 * 1024
DEFAULT_MAX_OUTBOX_BYTES = 4 * 1024 * 1024
CLOSE_TIMEOUT = 2.0
FLUSH_TIMEOUT = 10.0
"""How long a closing connection may take to hand its last queued bytes to a slow peer."""


class ConnectionClosed(Exception):
    """The connection was closed while a send was waiting."""


class PacketConnection:
    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        name: str = "peer",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES,
    ) -> None:
        self.stream = stream
        self.name = name
        self.reader = FrameReader(max_frame_size)
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

    # -- reading -----------------------------------------------------------

    async def receive_frame(self) -> Frame | None:
        """The next frame; ``None`` once the peer closed cleanly between frames."""
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                return frame
            data = await self.stream.receive_some(RECEIVE_SIZE)
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
) -> None:
    """Serve one connection with ``handler``; never lets a peer's fault escape."""
    conn = PacketConnection(
        stream, name=name, max_frame_size=max_frame_size, max_outbox_bytes=max_outbox_bytes
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
    max_outbox_bytes: int = DEFAULT_MAX_OUTBOX_BYTES,
) -> None:
    """Listen on ``host:port`` (0: any free port) and serve each connection.

    ``task_status.started`` receives the listeners, so callers learn the port.
    """

    async def on_connection(stream: trio.SocketStream) -> None:
        peer = peer_name(stream)
        with logs.bind(listener=label, peer=peer):
            await run_connection(
                stream,
                handler,
                name=f"{label} {peer}",
                max_frame_size=max_frame_size,
                max_outbox_bytes=max_outbox_bytes,
            )

    listeners = await trio.open_tcp_listeners(port, host=host)
    async with trio.open_nursery() as nursery:
        started = await nursery.start(trio.serve_listeners, on_connection, listeners)
        task_status.started(started)


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
