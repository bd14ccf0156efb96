"""What every direct capture shares: options, the upstream's vbuckets, the result.

A capture opens one memcached connection (``dialed``), authenticates (SASL
PLAIN) when asked, learns the vbuckets and their high seqnos from ``STAT
vbucket`` and ``STAT vbucket-seqno`` (``prepare``), then turns the same
connection into a TAP or UPR stream (``tap_capture``/``upr_capture``) whose
item events go to one ``CaptureRecorder``; ``record`` runs that stream and
ends it the same way for both: the last acks out, the segment closed.
"""

from __future__ import annotations

import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from adapters.errors import GatewayError
from gateway.io.connection import PacketConnection, RequestFailed
from gateway.tools.capture.recorder import CaptureRecorder
from gateway.tools.capture.records import Kind
from gateway.tools.capture.segments import DEFAULT_MAX_SEGMENT_BYTES

DEFAULT_BUFFER_SIZE = 10 * 1024 * 1024
"""UPR connection_buffer_size the capture announces."""
FLUSH_SECONDS = 2.0
"""How long the last acks may take to leave once the capture ends."""


class CaptureFailed(GatewayError):
    """The upstream refused or broke the capture; the message says how."""


@dataclass(frozen=True)
class CaptureOptions:
    host: str
    port: int
    out: Path
    until_caught_up: bool = False
    user: str | None = None
    password: str = ""
    name: str | None = None
    """Connection name (TAP client name / UPR connection name); default derived."""
    vbuckets: tuple[int, ...] | None = None
    """Only these vbuckets (default: every active one)."""
    dialect: str = "dcp"
    buffer_size: int = DEFAULT_BUFFER_SIZE
    max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES
    ssl_context: ssl.SSLContext | None = None
    """TLS to the endpoint (``--tls``), else plain TCP."""
    on_recorder: Callable[[CaptureRecorder], None] | None = None
    """Told the recorder once it exists (a two-sided capture watches and cuts through it)."""

    def connection_name(self, side: str) -> str:
        return self.name or f"capture-{side}-{self.host}-{self.port}"


@dataclass
class CaptureResult:
    side: str
    connection: str
    vbuckets: list[int]
    start_high_seqnos: dict[int, int]
    kinds: Counter[str] = field(default_factory=Counter)
    caught_up: set[int] = field(default_factory=set)
    stopped: str = "running"
    """Why the capture ended: caught-up, stopped (signal), server-closed."""
    recorded: int = 0
    dropped: int = 0
    write_errors: int = 0
    segments: int = 0
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def count(self, kind: Kind) -> None:
        self.kinds[kind.label] += 1

    @property
    def items(self) -> int:
        return sum(n for k, n in self.kinds.items() if Kind[k.upper()].is_item)

    def finish(self, recorder: CaptureRecorder) -> None:
        self.seconds = time.monotonic() - self.started
        self.recorded = recorder.written
        self.dropped = recorder.dropped
        self.write_errors = recorder.write_errors
        self.segments = len(recorder.writer.paths)

    def summary(self) -> str:
        rate = self.items / self.seconds if self.seconds else 0.0
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())) or "nothing"
        return (
            f"{self.side} capture {self.connection}: {self.stopped}; {self.items} items "
            f"({rate:,.0f}/s) over {len(self.vbuckets)} vbuckets, "
            f"{len(self.caught_up)} caught up; records: {kinds}; "
            f"{self.recorded} written to {self.segments} segments, {self.dropped} dropped"
        )


async def prepare(
    client: PacketConnection, options: CaptureOptions
) -> tuple[list[int], dict[int, int]]:
    """Authenticate, then the vbuckets to capture and their high seqnos now."""
    if options.user is not None:
        try:
            await client.sasl_plain(options.user, options.password)
        except RequestFailed as exc:
            raise CaptureFailed(f"authentication as {options.user!r} refused: {exc}") from None
    try:
        seqnos = await client.stats("vbucket-seqno")
    except RequestFailed as exc:
        raise CaptureFailed(f"STAT vbucket-seqno refused: {exc}") from None
    high: dict[int, int] = {}
    for name, value in seqnos.items():
        prefix, _, stat = name.partition(":")
        if stat == "high_seqno" and prefix.startswith("vb_") and prefix[3:].isdigit():
            high[int(prefix[3:])] = int(value)
    if not high:
        raise CaptureFailed("the server reported no vbuckets in STAT vbucket-seqno")
    try:
        states = await client.stats("vbucket")
    except RequestFailed:
        states = {}  # a server without the group: take every vbucket it reported
    active = sorted(vb for vb in high if states.get(f"vb_{vb}", "active").split()[0] == "active")
    if options.vbuckets is not None:
        missing = sorted(set(options.vbuckets) - set(active))
        if missing:
            raise CaptureFailed(f"vbuckets {missing} are not active on the server")
        active = sorted(options.vbuckets)
    return active, {vb: high[vb] for vb in active}


def new_recorder(options: CaptureOptions, side: str, connection: str) -> CaptureRecorder:
    recorder = CaptureRecorder(
        options.out,
        side="tap" if side == "tap" else "upr",
        connection=connection,
        direction="received",
        max_segment_bytes=options.max_segment_bytes,
        extra={"upstream": f"{options.host}:{options.port}", "dialect": options.dialect},
    )
    if options.on_recorder is not None:
        options.on_recorder(recorder)
    return recorder


@asynccontextmanager
async def dialed(options: CaptureOptions, side: str) -> AsyncIterator[PacketConnection]:
    """The capture's one connection to the server, closed on the way out."""
    client = await PacketConnection.connect(
        options.host,
        options.port,
        name=f"{side} {options.host}:{options.port}",
        ssl_context=options.ssl_context,
    )
    try:
        yield client
    finally:
        await client.aclose()


async def record(
    conn: PacketConnection,
    recorder: CaptureRecorder,
    result: CaptureResult,
    task_status: trio.TaskStatus[CaptureResult],
    *,
    start: Callable[[], None],
    consume: Callable[[], Awaitable[None]],
) -> None:
    """Run ``recorder`` and ``conn``'s writer, ``start`` the streams, hand ``result``
    to ``task_status``, then ``consume`` until it returns.

    However it ends (caught up, the server closed, cancelled), the last acks
    go out before the socket closes and the segment is closed cleanly, so
    ``result`` is complete by the time this returns or raises.
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        conn.start_writer(nursery)
        try:
            start()
            task_status.started(result)
            await consume()
        finally:
            with trio.CancelScope(shield=True):
                conn.finish()
                with trio.move_on_after(FLUSH_SECONDS):
                    await conn.writer_done.wait()
                await recorder.close()
                result.finish(recorder)
            nursery.cancel_scope.cancel()
