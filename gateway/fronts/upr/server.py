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

Takeover (``takeover``): a takeover stream that has caught up calls the
``take_over`` its connection passed down, which opens a TAP takeover connection for its vbucket and
turns the node's VBUCKET_SET messages into the stream's SET_VBUCKET_STATE,
acking each only once the consumer replied; the active state goes out only
once every record served is synced and the vbucket is recorded as handed
over. From then on, across restarts too, the vbucket is dead here: not
served (NOT_MY_VBUCKET), not ingested (other streams on it stay open, as in 3.0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio

from adapters import upr
from adapters.mcbp import Frame, Opcode
from adapters.upr.opening import open_connection
from gateway.fronts.upr.compaction import CompactionError, compact_log
from gateway.fronts.upr.config import UprFrontConfig
from gateway.fronts.upr.ingest import Ingest
from gateway.fronts.upr.logset import LogOptions, LogSet
from gateway.fronts.upr.producer import UprConnection, delete_kind
from gateway.fronts.upr.stat_groups import collect
from gateway.fronts.upr.takeover import (
    log_handed_over,
    read_handed_over,
    write_handed_over,
)
from gateway.io.auth import Authenticator, Users
from gateway.io.connection import PacketConnection
from gateway.io.door import OPEN_OPCODES, Door
from gateway.io.listen import bound_port
from gateway.io.named import NamedConnections
from gateway.metrics.figures import UPR_FRONT, GatewayStats, StreamStats
from gateway.runtime import logs
from gateway.runtime.memory import TrimAfterCloses
from gateway.runtime.version import version
from gateway.tools.capture.mapping import TapRecording, UprRecording
from gateway.tools.capture.recorder import CaptureRecorder, Direction, Side

log = logging.getLogger(__name__)

LABEL = "upr-front"
_OPEN_WITHOUT_AUTH = OPEN_OPCODES - {Opcode.SASL_STEP}
"""SASL_STEP before SASL succeeded gets ``authenticate first`` here, as it always did."""


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
        self.taken_over: set[int] = set()
        """Vbuckets handed over to a UPR consumer: dead here (``takeover``)."""
        self.ingest = Ingest(config, self.logs, self.stats, handed_over=self.taken_over)
        self.users = Users.of(config.users)
        self.connections: NamedConnections[UprConnection] = NamedConnections("UPR front")
        self.trimmer = TrimAfterCloses()
        """Gives the heap of closed connections back to the system."""
        self.door = Door(
            LABEL,
            self.users,
            config.limits,
            self.stats.listeners,
            f"tap-upr-gateway {version()} (UPR front)",
            self._stat,
            stream_opcodes=self.dialect.commands,
            begin_stream=self._become_producer,
            stray_response="unexpected response before OPEN",
            open_opcodes=_OPEN_WITHOUT_AUTH,
        )
        self.log_swaps = trio.Lock()
        """Held by a compaction of one log, and while a damaged log is set aside: a
        compaction must not write into a directory renamed under it."""
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
        await self._open_logs()
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
                        self.door.listen,
                        host,
                        port,
                        max_frame_size=self.config.max_frame_size,
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

    async def _open_logs(self) -> None:
        root = self.config.state_dir
        dead = read_handed_over(root)  # first: a log set aside takes its file along
        await self.logs.open_existing_async()  # proofs and fsyncs off the trio loop
        for vb, text in dead.items():
            vblog = self.logs.get(vb)
            if vblog is not None and vblog.set_aside is not None:
                await trio.to_thread.run_sync(write_handed_over, vblog.dir, text + "\n")
        self.taken_over.update(dead)
        log_handed_over(root, dead)

    async def _compaction_loop(self) -> None:
        while True:
            await trio.sleep(self.config.compact_interval)
            await self.compact()

    async def compact(self) -> int:
        """One compaction round over every vbucket; bytes reclaimed."""
        saved = 0
        for vblog in list(self.logs):
            async with self.log_swaps:
                if self.logs.get(vblog.vbucket) is vblog:  # else set aside meanwhile
                    try:
                        saved += await compact_log(vblog, time.time(), self.config.purge_interval)
                    except CompactionError as exc:  # a full disk: serving goes on
                        log.error("%s; tried again in %gs", exc, self.config.compact_interval)
        self.stats.upr_log.compactions_total += 1
        self.logs.refresh_stats()
        return saved

    # -- connections -----------------------------------------------------------

    async def _stat(self, request: str) -> list[tuple[str, str]]:
        return collect(self, request)

    async def _become_producer(
        self, conn: PacketConnection, frame: Frame, _auth: Authenticator
    ) -> bool:
        """Serve a UPR producer connection for the rest of the connection's life;
        False when ``frame`` was refused with an answer."""
        peer = conn.name.rpartition(" ")[2]
        opening = open_connection(frame, self.dialect, peer, consumers=False)
        if opening.role is None:
            await conn.send(opening.reply)
            if opening.closing is not None:
                self.stats.protocol_errors_total[(UPR_FRONT, "malformed")] += 1
                raise opening.closing
            return False
        name = opening.name
        logs.name_connection(name)
        conn.streaming()
        stream_stats = StreamStats(
            direction=UPR_FRONT, connection=name, upstream=self.ingest.address, created=time.time()
        )
        with self.stats.stream(stream_stats):
            producer = UprConnection(self, conn, name, opening.flags, stream_stats)
            try:
                with self.connections.running(name, producer):  # a namesake replaces it
                    async with self._capture(producer):
                        if opening.reply:
                            await conn.send(opening.reply)  # the OPEN's OK
                        await producer.run(opening.first)
            finally:
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
    async def capture_takeover(self, ingest: Ingest) -> AsyncIterator[None]:
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
