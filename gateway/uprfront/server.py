"""The UPR front: the durable log, the upstream ingest and the UPR listener together.

Theory of operation. ``UprFront.run`` opens the logs found in the state
directory, starts the ingest (one TAP connection upstream) and a compaction
timer, and listens for UPR consumers. Each connection starts as a memcached
command connection: SASL PLAIN (required first when ``users`` is set),
NOOP, VERSION and STAT (``vbucket``, ``vbucket-seqno [vb]``, ``failovers``,
``upr``/``dcp``, ``dcp-vbtakeover <vb> <name>``) are answered there; OPEN with the
producer flag (or, in the draft dialect, a first STREAM_REQ or
GET_FAILOVER_LOG) turns it into a ``UprConnection`` for the rest of its
life. Reopening a name closes the older connection of that name.

Captures (``capture_dir``): one recorder for what the ingest receives from
the TAP node (side tap, received, named after the TAP client name) and one
per consumer connection for what it is sent (side upr, sent, named after
the OPEN name), each a ``CaptureRecorder`` that drops and counts rather than
block a stream when the disk falls behind.

Takeover: a takeover stream that has caught up calls ``take_over``, which
opens a TAP takeover connection for its vbucket and turns the node's
VBUCKET_SET messages into the stream's SET_VBUCKET_STATE, acking each only
once the consumer replied. When the node closes that connection the
vbucket is no longer served here (other streams on it end STATE_CHANGED).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial

import trio

from adapters import upr
from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import Frame, Magic, Opcode, Status, encode_frame
from adapters.mcbp.constants import VBucketState
from gateway import logs
from gateway.auth import Authenticator, Users
from gateway.capture.mapping import TapRecording, UprRecording
from gateway.capture.recorder import CaptureRecorder, Direction, Side
from gateway.memory import TrimAfterCloses
from gateway.stats import UPR_FRONT, GatewayStats, StreamStats
from gateway.upr_producer_base import error_reply
from gateway.uprfront.compaction import compact_log
from gateway.uprfront.config import UprFrontConfig, UprFrontError
from gateway.uprfront.ingest import Ingest
from gateway.uprfront.logset import LogOptions, LogSet
from gateway.uprfront.producer import UprConnection, delete_kind
from gateway.uprfront.stat_groups import StatError, collect
from gateway.uprfront.streams import LogStream
from gateway.version import version
from gateway.wire import PacketConnection, bound_port, serve_packets

log = logging.getLogger(__name__)

LABEL = "upr-front"
_OPEN_WITHOUT_AUTH = frozenset(
    {Opcode.SASL_LIST_MECHS, Opcode.SASL_AUTH, Opcode.NOOP, Opcode.VERSION}
)


def _response(frame: Frame, status: int = 0, *, key: bytes = b"", value: bytes = b"") -> bytes:
    return encode_frame(
        Magic.RESPONSE,
        frame.opcode,
        vbucket_or_status=status,
        opaque=frame.opaque,
        key=key,
        value=value,
    )


class UprFront:
    def __init__(self, config: UprFrontConfig, stats: GatewayStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else GatewayStats()
        self.dialect = upr.get_dialect(config.dialect)
        self.logs = LogSet(
            config.state_dir,
            LogOptions(
                config.fsync, config.segment_bytes, config.expiry_tolerance, config.tail_bytes
            ),
            self.stats,
            seed=config.seed,
        )
        self.ingest = Ingest(config, self.logs, self.stats)
        self.users = Users.of(config.users)
        self.connections: dict[str, UprConnection] = {}
        self.trimmer = TrimAfterCloses()
        """Gives the heap of closed connections back to the system."""
        self._scopes: dict[str, trio.CancelScope] = {}
        self.taken_over: set[int] = set()
        self.port = 0

    def serves(self, vbucket: int) -> bool:
        return vbucket in self.logs.logs and vbucket not in self.taken_over

    # -- running ---------------------------------------------------------------

    async def run(
        self,
        *,
        close_logs: bool = True,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.logs.open_existing()
        try:
            async with trio.open_nursery() as nursery:
                if self.config.capture_dir is not None:
                    recorder = self._recorder("tap", self.ingest.name, "received")
                    await nursery.start(recorder.run)
                    self.ingest.recording = TapRecording(recorder)
                nursery.start_soon(self.ingest.run)
                if self.config.compact_interval > 0:
                    nursery.start_soon(self._compaction_loop)
                nursery.start_soon(self.trimmer.run)
                host, port = self.config.listen
                listeners = await nursery.start(
                    partial(
                        serve_packets,
                        self.handle,
                        host,
                        port,
                        label=LABEL,
                        max_frame_size=self.config.max_frame_size,
                        limits=self.config.limits,
                        auth_required=self.users is not None,
                        counters=self.stats.listeners,
                        ssl_context=self.config.ssl_context,
                        max_outbox_bytes=self.config.max_outbox_bytes,
                    )
                )
                self.port = bound_port(listeners)
                log.debug("UPR front bound %s:%d", host, self.port)  # serve announces
                task_status.started(self.port)
        finally:
            if close_logs:
                self.logs.close()
            else:
                self.logs.abandon()

    async def _compaction_loop(self) -> None:
        while True:
            await trio.sleep(self.config.compact_interval)
            await self.compact()

    async def compact(self) -> int:
        """One compaction round over every vbucket; bytes reclaimed."""
        saved = 0
        for vblog in list(self.logs):
            saved += await compact_log(vblog, time.time(), self.config.purge_interval)
        self.stats.upr_log.compactions_total += 1
        self.logs.refresh_stats()
        return saved

    # -- connections -----------------------------------------------------------

    async def handle(self, conn: PacketConnection) -> None:
        limits = self.config.limits
        auth = conn.authority = Authenticator(
            self.users,
            label=LABEL,
            peer=conn.name.rpartition(" ")[2],
            counters=self.stats.listeners,
            max_failures=limits.max_auth_failures,
            failure_delay=limits.auth_failure_delay,
        )
        authenticated = self.users is None
        while (frame := await conn.receive_frame()) is not None:
            if frame.magic != Magic.REQUEST:
                raise ProtocolError(
                    "unexpected response before OPEN",
                    opcode=frame.opcode,
                    field="magic",
                    value=frame.magic,
                )
            if not authenticated and frame.opcode not in _OPEN_WITHOUT_AUTH:
                await conn.send(error_reply(frame, Status.AUTH_ERROR, "authenticate first"))
                continue
            if frame.opcode == Opcode.SASL_LIST_MECHS:
                await conn.send(_response(frame, value=b"PLAIN"))
            elif frame.opcode == Opcode.SASL_AUTH:
                authenticated = await self._sasl(conn, frame, auth) or authenticated
            elif frame.opcode == Opcode.NOOP:
                await conn.send(_response(frame))
            elif frame.opcode == Opcode.VERSION:
                await conn.send(
                    _response(frame, value=f"tap-upr-gateway {version()} (UPR front)".encode())
                )
            elif frame.opcode == Opcode.STAT:
                await self._stat(conn, frame)
            elif frame.opcode in self.dialect.commands:
                if await self._become_producer(conn, frame):
                    return
            else:
                await conn.send(
                    error_reply(
                        frame, Status.UNKNOWN_COMMAND, f"unknown command 0x{frame.opcode:02x}"
                    )
                )

    async def _sasl(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> bool:
        outcome = await auth.authenticate(frame)
        if outcome.user is None:
            await conn.send(error_reply(frame, Status.AUTH_ERROR, outcome.message))
            if outcome.closing is not None:
                raise outcome.closing
            return False
        conn.authenticated()
        await conn.send(_response(frame, value=b"Authenticated"))
        return True

    async def _stat(self, conn: PacketConnection, frame: Frame) -> None:
        request = frame.key.decode("utf-8", "replace")
        try:
            pairs = collect(self, request)
        except StatError as exc:
            await conn.send(error_reply(frame, exc.status, str(exc)))
            return
        out = [_response(frame, key=k.encode(), value=v.encode()) for k, v in pairs]
        out.append(_response(frame))
        await conn.send(b"".join(out))

    async def _become_producer(self, conn: PacketConnection, frame: Frame) -> bool:
        try:
            event = upr.decode_frame(frame, self.dialect)
        except ProtocolError as exc:
            conn.send_nowait(error_reply(frame, exc.status or Status.INVALID_ARGUMENTS, str(exc)))
            self.stats.protocol_errors_total[(UPR_FRONT, "malformed")] += 1
            raise
        first: upr.UprEvent | None = None
        if isinstance(event, upr.Open):
            if not event.flags & upr.OpenFlags.PRODUCER:
                await conn.send(
                    error_reply(
                        frame, Status.NOT_SUPPORTED, "the gateway only serves producer connections"
                    )
                )
                return False
            name = event.name.decode("utf-8", "replace")
            flags = event.flags
        elif (
            isinstance(event, upr.StreamRequest | upr.GetFailoverLog)
            and self.dialect is upr.UPR_DRAFT
        ):
            name, flags, first = (
                "upr-draft:" + conn.name.rpartition(" ")[2],
                upr.OpenFlags(0),
                event,
            )
        else:
            await conn.send(
                error_reply(
                    frame, Status.INVALID_ARGUMENTS, f"{event.NAME} needs an open UPR connection"
                )
            )
            return False
        logs.name_connection(name)
        conn.streaming()
        stream_stats = StreamStats(
            direction=UPR_FRONT, connection=name, upstream=self.ingest.address, created=time.time()
        )
        with self.stats.stream(stream_stats), self._named(name) as scope:
            producer = UprConnection(self, conn, name, flags, stream_stats)
            self.connections[name] = producer
            try:
                with scope:
                    async with self._capture(producer):
                        if isinstance(event, upr.Open):
                            await producer.respond(upr.Response(upr.Command.OPEN, event.opaque, 0))
                        await producer.run(first)
            finally:
                if self.connections.get(name) is producer:
                    del self.connections[name]
                self.trimmer.connection_closed()
        return True

    # -- captures ---------------------------------------------------------------

    def _recorder(self, side: Side, connection: str, direction: Direction) -> CaptureRecorder:
        assert self.config.capture_dir is not None
        return CaptureRecorder(
            self.config.capture_dir, side=side, connection=connection, direction=direction
        )

    @asynccontextmanager
    async def _capture(self, producer: UprConnection) -> AsyncIterator[None]:
        """Record what ``producer`` sends while inside (``capture_dir`` set)."""
        if self.config.capture_dir is None:
            yield
            return
        recorder = self._recorder("upr", producer.name, "sent")
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            producer.recording = UprRecording(
                recorder, delete_kind=delete_kind(producer.settings.expiry_opcode)
            )
            try:
                yield
            finally:
                producer.recording = None
                await recorder.close()

    @asynccontextmanager
    async def _capture_takeover(self, ingest: Ingest) -> AsyncIterator[None]:
        if self.config.capture_dir is None:
            yield
            return
        recorder = self._recorder("tap", ingest.name, "received")
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            ingest.recording = TapRecording(recorder)
            try:
                yield
            finally:
                await recorder.close()

    @contextmanager
    def _named(self, name: str) -> Iterator[trio.CancelScope]:
        old = self._scopes.get(name)
        if old is not None:
            old.cancel()  # the name is reused: the old connection goes
        scope = self._scopes[name] = trio.CancelScope()
        try:
            yield scope
        finally:
            if self._scopes.get(name) is scope:
                del self._scopes[name]

    # -- takeover --------------------------------------------------------------

    async def take_over(self, stream: LogStream) -> upr.StreamEndReason:
        """Take ``stream``'s vbucket over from the TAP node, through ``stream``."""
        vb = stream.vbucket
        self.stats.takeovers_started_total[UPR_FRONT] += 1
        handed: list[VBucketState] = []  # states the consumer has replied to

        async def on_state(vbucket: int, state: VBucketState) -> None:
            if vbucket != vb:
                return
            await stream.set_state(state)
            handed.append(state)

        ingest = Ingest(
            self.config,
            self.logs,
            self.stats,
            name=f"{self.config.tap_name}-takeover-{vb}",
            vbuckets=(vb,),
            takeover=True,
            state_hook=on_state,
        )
        try:
            async with self._capture_takeover(ingest):
                await ingest.session()
            if VBucketState.ACTIVE not in handed:
                raise UprFrontError("the TAP node closed the takeover before handing it over")
        except (OSError, trio.BrokenResourceError, GatewayError) as exc:
            if VBucketState.ACTIVE not in handed:
                log.warning("vbucket %d: takeover from the TAP node failed: %s", vb, exc)
                return upr.StreamEndReason.STATE_CHANGED
            # The node made its vbucket dead before it sent VBUCKET_SET(active)
            # and the consumer has taken it: the hand-off is done, however the
            # node then drops the connection (a reset when it closes with our
            # last ack or NOOP reply unread is ordinary TCP).
            log.info(
                "vbucket %d: TAP node ended the takeover connection after the hand-off: %s", vb, exc
            )
        self.taken_over.add(vb)
        await stream.catch_up()
        for connection in list(self.connections.values()):
            other = connection.streams.get(vb)
            if other is not None and other is not stream and other.live:
                other.close(upr.StreamEndReason.STATE_CHANGED)
        self.stats.takeovers_completed_total[UPR_FRONT] += 1
        return upr.StreamEndReason.OK
