"""One memcached-binary connection type over trio, for accepted and dialed sockets.

``PacketConnection`` wraps one socket (TCP or TLS): a frame reader with the
stage's size and time limits (``gateway.io.limits``) and two ways to write.

- Served (``run_connection``, and any stream that calls ``start_writer``):
  ``send`` queues bytes and a writer task joins everything queued since its
  last write into one ``send_all`` (per-packet writes cost many times more in
  Python). When nothing is queued and the writer is idle, a plain TCP socket
  is written at once by the sender (one non-blocking write, no hop to the
  writer task: a live stream's one-item batches would otherwise cost a task
  switch each); what the kernel does not take is queued for the writer. Sends
  in quick succession queue, so a busy connection's bursts still go out in one
  ``send_all``. The
  outbox is bounded in bytes: ``send`` waits while more than
  ``max_outbox_bytes`` are queued, so a slow peer pushes back on whoever
  produces for it.
- Dialed command use (``connect``: STAT, SASL, requests; a relay): until a
  writer starts, ``send`` writes at once, one sender at a time.

The owner reads with ``receive_frame`` (``None`` at a clean end of stream) or
``next_frame`` (the end of stream is an error naming the peer), or a socket
read at a time with ``receive_data`` to frame in place; ``request``,
``stats`` and ``sasl_plain`` are the client side of a command connection.
Failures to reach a peer are ``OSError`` whose one line names it.

``run_connection`` runs a handler with its writer in one nursery, flushes
what the handler queued when it returns, and closes the socket with a
shielded, time-limited cleanup. A ``ProtocolError`` from the handler is
logged with the peer's name and closes only that connection. Listening
(``serve_packets``) lives in ``gateway.io.listen``.

A listener's connections carry ``ConnectionLimits``: the handler moves a
connection from stage to stage (``authenticated``, ``streaming``) and the
reader enforces each stage's frame size and time limits before buffering a
body.
"""

from __future__ import annotations

import itertools
import logging
import os
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    Frame,
    FrameReader,
    Magic,
    Opcode,
    Status,
    encode_frame,
)
from adapters.mcbp.constants import status_name
from gateway.io.limits import NO_LIMITS, ConnectionLimits, ListenerCounters, Stage

if TYPE_CHECKING:
    from gateway.io.auth import Authenticator

log = logging.getLogger(__name__)

RECEIVE_SIZE = 256 * 1024
DEFAULT_MAX_OUTBOX_BYTES = 4 * 1024 * 1024
CLOSE_TIMEOUT = 2.0
DIRECT_WRITE_GAP_NS = 100_000
"""A write this soon after the last direct one queues instead: on a busy connection
the writer's one ``send_all`` per burst costs less than a system call per send."""
FLUSH_TIMEOUT = 10.0
"""How long a closing connection may take to hand its last queued bytes to a slow peer."""


class ConnectionClosed(Exception):
    """The connection was closed while a send was waiting."""


class ConnectionTimeout(ProtocolError):
    """The peer took too long (to authenticate, to start streaming, to finish a frame)."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


class ConnectionLost(ProtocolError):
    """The peer closed a connection we were reading a frame or an answer from."""


class RequestFailed(GatewayError):
    """The server answered a request with an error status."""

    def __init__(self, opcode: int, status: int, text: bytes) -> None:
        self.opcode = opcode
        self.status = status
        self.text = text
        detail = text.decode("utf-8", "replace")
        super().__init__(
            f"opcode 0x{opcode:02x} failed: {status_name(status)} (0x{status:02x})"
            + (f": {detail}" if detail else "")
        )


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
        self._writing = False
        """A writer task serves the outbox; until one does, ``send`` writes at once."""
        self._writer_busy = False
        """The writer is inside ``send_all``: a direct write now would interleave with it."""
        self._direct = isinstance(stream, trio.SocketStream)
        """Plain sockets take direct writes (TLS and test streams always queue)."""
        self._last_direct_ns = -DIRECT_WRITE_GAP_NS
        self._send_lock = trio.Lock()
        self._opaques = itertools.count(1)

    # -- dialing -----------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        name: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> PacketConnection:
        """Dial ``host:port`` over TCP, or TLS when ``ssl_context`` is given. ``name``
        (default ``host:port``) is how errors and logs call the peer."""
        from gateway.io.tls import open_stream

        stream = await open_stream(host, port, ssl_context)
        return cls(stream, name=name or f"{host}:{port}", max_frame_size=max_frame_size)

    async def __aenter__(self) -> PacketConnection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the socket (shielded: a cancelled caller still releases it)."""
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            scope.shield = True
            await self.stream.aclose()
        self._outbox.clear()  # unsendable now

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

    async def next_frame(self) -> Frame:
        """The next frame; the peer closing or resetting first is a ``ConnectionLost``
        naming it."""
        try:
            frame = await self.receive_frame()
        except trio.BrokenResourceError as exc:
            raise self._lost(exc) from None
        if frame is None:
            raise ConnectionLost(f"{self.name} closed the connection")
        return frame

    def _lost(self, exc: trio.BrokenResourceError) -> ConnectionLost:
        cause = exc.__cause__
        why = getattr(cause, "strerror", None) or getattr(cause, "reason", None) or cause
        return ConnectionLost(f"{self.name} closed the connection ({why or 'broken'})")

    def next_buffered_frame(self) -> Frame | None:
        """A frame already received, without waiting for the network."""
        return self.reader.next_frame()

    async def receive_data(self) -> int:
        """Add the next socket read to ``reader`` as it comes (no stage limits, no
        deadlines: for a caller that frames a whole read at once in place, a dialed
        stream's consumer); how many bytes came, 0 at the end of stream."""
        data = await self.stream.receive_some(RECEIVE_SIZE)
        if data:
            self.bytes_received += len(data)
            self.reader.receive_data(data)
        return len(data)

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
        """Queue ``data`` for the writer, waiting while the outbox is over its limit;
        before a writer runs, write it now (one sender at a time)."""
        if not self._writing:
            async with self._send_lock:
                try:
                    await self.stream.send_all(data)
                except trio.BrokenResourceError as exc:
                    raise self._lost(exc) from None
            self.bytes_sent += len(data)
            return
        if self._outbox_bytes >= self.max_outbox_bytes and not self._closing:
            await self.wait_for_room()
            # Woken after its scope was cancelled (a stream the consumer closed
            # meanwhile): send nothing, or it would follow the answer that ended it.
            await trio.lowlevel.checkpoint_if_cancelled()
        self.send_nowait(data)

    def send_nowait(self, data: bytes) -> None:
        """Queue ``data`` regardless of the limit (small control replies); with nothing
        queued and the writer idle, hand what the kernel takes to the socket now."""
        if self._closing:
            raise ConnectionClosed(self.name)
        if (
            self._direct
            and not self._outbox
            and (now := time.perf_counter_ns()) - self._last_direct_ns >= DIRECT_WRITE_GAP_NS
            and not self._writer_busy
            and self._writing
            and not self._writer_done.is_set()
        ):
            self._last_direct_ns = now
            data = self._write_now(data)
            if not data:
                return
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        if self._outbox_bytes > self.peak_outbox_bytes:
            self.peak_outbox_bytes = self._outbox_bytes
        self._has_data.set()

    async def drain(self) -> None:
        """Wait until everything queued so far has been handed to the socket."""
        while self._outbox_bytes and not self._writer_done.is_set():
            await self._room_event().wait()

    def _write_now(self, data: bytes) -> bytes:
        """One non-blocking write on the socket; returns what it did not take.

        Synchronous, so it can neither be cancelled half way nor interleave with
        another sender. A full buffer or an error leaves the bytes to the writer,
        whose ``send_all`` waits or fails exactly as it would have without this."""
        assert isinstance(self.stream, trio.SocketStream)
        fd = self.stream.socket.fileno()
        if fd < 0:
            return data
        try:
            sent = os.write(fd, data)
        except OSError:
            return data
        self.bytes_sent += sent
        return data[sent:] if sent else data

    def _room_event(self) -> trio.Event:
        """The event the next write sets; shared by every waiter (one fresh per write),
        so a second waiter never strands the first on an event nobody will set."""
        if self._has_room.is_set():
            self._has_room = trio.Event()
        return self._has_room

    @property
    def writer_done(self) -> trio.Event:
        return self._writer_done

    def start_writer(self, nursery: trio.Nursery) -> None:
        """From now on ``send`` queues and a writer task in ``nursery`` writes."""
        self._writing = True
        nursery.start_soon(self._run_writer)

    async def _run_writer(self) -> None:
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
                self._writer_busy = True
                try:
                    await self.stream.send_all(batch)
                finally:
                    self._writer_busy = False
                self.bytes_sent += len(batch)
                self._outbox_bytes -= len(batch)
                self._has_room.set()
        finally:
            # Nothing queued goes out any more: drop it now rather than when the
            # connection's reference cycles are collected (up to the outbox limit each).
            self._outbox.clear()
            self._writer_done.set()
            self._has_room.set()

    def finish(self) -> None:
        """No more sends: the writer flushes what is queued, then stops."""
        self._closing = True
        self._has_data.set()
        self._has_room.set()

    # -- the client side of a command connection ---------------------------

    def next_opaque(self) -> int:
        return next(self._opaques) & 0xFFFFFFFF

    async def request(
        self,
        opcode: int,
        *,
        key: bytes = b"",
        value: bytes = b"",
        extras: bytes = b"",
        vbucket: int = 0,
        cas: int = 0,
        check: bool = True,
    ) -> Frame:
        """Send one request and return its response (raise on error status if ``check``).
        Requests are answered in order; frames with other opaques are passed over."""
        opaque = self.next_opaque()
        await self.send(
            encode_frame(
                Magic.REQUEST,
                opcode,
                vbucket_or_status=vbucket,
                opaque=opaque,
                cas=cas,
                extras=extras,
                key=key,
                value=value,
            )
        )
        while True:
            frame = await self.next_frame()
            if frame.magic == Magic.RESPONSE and frame.opaque == opaque:
                break
        if check and frame.vbucket_or_status != Status.SUCCESS:
            raise RequestFailed(opcode, frame.vbucket_or_status, frame.value)
        return frame

    async def stats(self, group: str = "") -> dict[str, str]:
        """``STAT group``: the key/value responses up to the empty one."""
        opaque = self.next_opaque()
        await self.send(encode_frame(Magic.REQUEST, Opcode.STAT, opaque=opaque, key=group.encode()))
        out: dict[str, str] = {}
        while True:
            frame = await self.next_frame()
            if frame.opaque != opaque or frame.magic != Magic.RESPONSE:
                continue
            if frame.vbucket_or_status != Status.SUCCESS:
                raise RequestFailed(Opcode.STAT, frame.vbucket_or_status, frame.value)
            if not frame.key:
                return out
            out[frame.key.decode("utf-8", "replace")] = frame.value.decode("utf-8", "replace")

    async def sasl_plain(self, user: str, password: str) -> None:
        """Authenticate with SASL PLAIN (authzid empty)."""
        token = b"\x00" + user.encode() + b"\x00" + password.encode()
        await self.request(Opcode.SASL_AUTH, key=b"PLAIN", value=token)


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
            conn.start_writer(nursery)
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
            log.warning("%s: closing connection: %s%s", name, refused, other_protocol(refused))
    except* ProtocolError as group:
        first = _first(group)
        log.warning("%s: closing connection: %s%s", name, first, other_protocol(first))
    except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionClosed) as group:
        log.info("%s: connection lost: %s", name, _first(group) or "closed")
    except* GatewayError as group:
        # A fault the gateway names (a log it cannot read, ...): one line, no traceback.
        log.error("%s: closing connection: %s", name, _first(group))
    except* Exception as group:
        # A bug must cost this one connection, not the listener and its peers.
        log.error("%s: internal error, closing connection", name, exc_info=_first(group))
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            scope.shield = True
            await stream.aclose()


_HTTP_METHOD_STARTS = frozenset(b"GHPDOCT")
"""First bytes of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, CONNECT, TRACE."""


def other_protocol(exc: BaseException) -> str:
    """A hint for the log when a peer's very first byte shows it speaks HTTP or TLS
    (curl or a browser pointed at a data port, a TLS client at a plain one), since
    "bad magic byte ... value=71" alone does not say so; empty otherwise."""
    if not isinstance(exc, ProtocolError) or exc.field != "magic" or exc.offset != 0:
        return ""
    if exc.value in _HTTP_METHOD_STARTS:
        return (
            " (the peer speaks HTTP: this is a memcached binary port;"
            " metrics and /readyz are on --metrics-listen)"
        )
    if exc.value == 0x16:
        return " (the peer speaks TLS: this port is plain memcached)"
    return ""


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The innermost first exception of a (possibly nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
