"""One TAP peer served from the UPR streams of an upstream node.

Theory of operation. A ``TapSession`` owns one TAP connection (a client that
sent CONNECT, or a TAP receiver the gateway pushes to) and one upstream UPR
connection of its own, and runs four tasks:

- the pump, the only task that writes stream messages: it requests one UPR
  stream per vbucket of the plan, then reads the upstream a socket read at a
  time and has ``UpstreamStreams`` (gateway/fronts/tap/upstream_streams.py)
  translate every frame into TAP messages, which ``TapPeer``
  (gateway/fronts/tap/peer.py) stamps into one batch written with one send;
- the reader (``TapPeer.read``): acks and nacks from the TAP peer, and what
  they release settled upstream (see below); a request that is not TAP's goes
  to the front's command door, answered between stream messages;
- the timers (``TapPeer.timers``): a NOOP on an idle TAP connection, the
  resend after a busy nack;
- the upstream's keeper (``UprUpstream.keep_alive``, one per upstream
  connection): while the pump waits on the TAP peer (a full ack window, a
  full outbox, the last acks), it reads on into the upstream's reader and
  answers the NOOPs there, so a 3.0 producer does not drop a connection
  whose TAP client is merely slow; the items stay for the pump.

Backpressure runs end to end. The upstream stops at the flow-control buffer
the gateway announced, and the gateway returns buffer bytes only for what
the TAP peer acknowledged (with support-ack) or what was handed to its
socket (without). Each batch's upstream bytes, the replies the upstream
waits for (SET_VBUCKET_STATE, acknowledged snapshot markers) and the
positions reached travel as a ``Settlement`` (``adapters.tap.settlement``)
attached to the last TAP message of the batch, and are settled when that
message is acked. The last
message of every batch asks for an ack, so a peer that acks only when asked
can never leave the upstream stalled on a full buffer. Memory per session is
bounded by the upstream buffer plus the socket outbox.

Upstream loss: the pump reconnects with backoff and re-requests every open
stream from the last seqno sent, within the snapshot it was in; the
translators continue the checkpoint or backfill that was open, so the TAP
peer sees neither a gap nor a duplicate. Acks keep arriving meanwhile and
never cost the TAP peer its connection: what they release is settled on
the TAP side (positions, counters) at once, while the upstream credit and
replies they carry lapse with the connection they were owed to. A rollback
answer restarts that vbucket with a full backfill behind
OPAQUE(INITIAL_VBUCKET_STREAM).
"""

from __future__ import annotations

import logging
import ssl
import time
from contextlib import AbstractContextManager, AsyncExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.tap import ConnectFlags, OpaqueCode, TapOpaque, TapStreamMessage
from adapters.tap.producer import TapProducer
from gateway.fronts.tap.peer import TapPeer
from gateway.fronts.tap.plan import ConnectionPlan
from gateway.fronts.tap.registry import Registry
from gateway.fronts.tap.upstream import (
    DEFAULT_NOOP_INTERVAL,
    UprUpstream,
    UprUpstreamError,
    UprUpstreamMalformed,
)
from gateway.fronts.tap.upstream_streams import UpstreamStreams
from gateway.io.connection import PacketConnection
from gateway.io.door import Answer, refuse_command
from gateway.metrics.figures import GatewayStats, StreamStats
from gateway.runtime.logs import Repeats
from gateway.tools.capture.mapping import TapRecording, UprRecording
from gateway.tools.capture.recorder import open_recorder
from gateway.tools.capture.records import Kind

__all__ = ["SessionConfig", "SessionFailed", "TapSession"]

log = logging.getLogger(__name__)


@dataclass
class SessionConfig:
    upstream: tuple[str, int]
    dialect: upr.Dialect = upr.DCP
    user: str | None = None
    password: str | None = None
    buffer_size: int = 8 * 1024 * 1024
    ack_interval: int = 1000
    max_unacked: int = 10_000
    backoff: float = 5.0
    noop_interval: float = 20.0
    """Idle seconds before a NOOP to the TAP peer."""
    upstream_noop_interval: int = DEFAULT_NOOP_INTERVAL
    """Seconds between the upstream's NOOPs (CONTROL set_noop_interval)."""
    reconnect_initial: float = 0.1
    reconnect_max: float = 5.0
    reconnect_attempts: int | None = None
    """Consecutive failed reconnects before giving up (None: never give up)."""
    capture_dir: Path | None = None
    """Record what each connection receives and sends there (see ``gateway.tools.capture``)."""
    ssl_context: ssl.SSLContext | None = None
    """TLS to the upstream (None: plain TCP)."""


class SessionFailed(ProtocolError):
    """The session cannot go on (upstream gone for good, a stream refused)."""


class TapSession:
    def __init__(
        self,
        conn: PacketConnection,
        plan: ConnectionPlan,
        config: SessionConfig,
        registry: Registry,
        stats: GatewayStats,
        *,
        closing_messages: tuple[TapStreamMessage, ...] = (),
        answer: Answer = refuse_command,
    ) -> None:
        self.conn = conn
        self.plan = plan
        self.config = config
        self.registry = registry
        self.gateway_stats = stats
        self.name = plan.name
        self._retry_log = Repeats()
        self.closing_messages = closing_messages
        """Sent once every stream ended and was acked (a push ends with CLOSE_TAP_STREAM)."""
        self.producer = TapProducer(
            support_ack=plan.support_ack,
            ack_interval=config.ack_interval,
            max_unacked=max(config.max_unacked, config.ack_interval),
            backoff=config.backoff,
        )
        upstream_name = "{}:{}".format(*config.upstream)
        self.stats = StreamStats("tap_front", plan.name, upstream_name, created=time.time())
        self.stats.ack_window = self.producer.max_unacked if plan.support_ack else 0
        self.peer = TapPeer(
            conn,
            self.producer,
            plan,
            registry,
            self.stats,
            stats,
            noop_interval=config.noop_interval,
            answer=answer,
        )
        self.streams = UpstreamStreams(plan, self.peer, registry, self.stats, stats)
        self.vbuckets = self.streams.vbuckets
        self.upstream: UprUpstream | None = None
        self.done = False

    # -- running -------------------------------------------------------------

    async def run(self) -> None:
        peer = self.peer
        with self.gateway_stats.stream(self.stats):
            try:
                async with AsyncExitStack() as captures, trio.open_nursery() as nursery:
                    await self._open_captures(captures)
                    nursery.start_soon(peer.read, nursery.cancel_scope)
                    nursery.start_soon(peer.timers)
                    await self._pump(nursery)
                    if self._stays_open():
                        await self._stay_open()
                    with self._away():
                        await peer.settle_all()
                        if self.closing_messages:
                            for message in self.closing_messages:
                                await peer.emit(message, None)
                            await peer.flush()
                            await peer.settle_all()
                        # Everything reaches the socket before the close, however slow
                        # the peer reads (a dump without acks has nothing else to wait on).
                        await self.conn.drain()
                    self.done = True
                    nursery.cancel_scope.cancel()
            finally:
                if self.upstream is not None:
                    await self.upstream.aclose()
                self.registry.save()

    async def _open_captures(self, stack: AsyncExitStack) -> None:
        """With a capture directory: record what arrives from upstream and what is sent."""
        directory = self.config.capture_dir
        if directory is None:
            return
        inbound = await stack.enter_async_context(
            open_recorder(directory, side="upr", connection=self.name, direction="received")
        )
        outbound = await stack.enter_async_context(
            open_recorder(directory, side="tap", connection=self.name, direction="sent")
        )
        # Without the expiry opcode a 3.0 producer sends every delete as DELETION.
        self.streams.captured_in = UprRecording(inbound, delete_kind=Kind.DELETE)
        self.peer.captured_out = TapRecording(outbound)

    def _away(self) -> AbstractContextManager[None]:
        """The pump is done reading: the upstream's keeper answers its NOOPs until
        the session ends (a slow peer's last acks may take longer than its interval)."""
        return nullcontext() if self.upstream is None else self.upstream.pump_away()

    async def _pump(self, nursery: trio.Nursery) -> None:
        peer = self.peer
        streams = self.streams
        streams.spawn = nursery.start_soon
        streams.retry_delays = (self.config.reconnect_initial, self.config.reconnect_max)
        for message in self._opening_messages():
            await peer.emit(message, None)
        await peer.flush()
        failures = 0
        while not streams.all_ended:
            try:
                upstream = await self._connect()
                nursery.start_soon(upstream.keep_alive)
                failures = 0
                self._retry_log.reset()
                await streams.request()
                while not streams.all_ended:
                    await upstream.receive()
                    await streams.on_data()
                    await peer.flush()
            except UprUpstreamError as exc:
                failures += 1
                await self._upstream_lost(exc, failures)
            except UprUpstreamMalformed:
                # Not retried (the upstream would send it again): what came
                # before reaches the peer, then both connections close.
                await peer.flush()
                raise
        await streams.finish()
        await peer.flush()

    def _stays_open(self) -> bool:
        """Whether the TAP connection outlives its streams. A 2.x producer closed a
        connection on its own only once a dump or a takeover was done (ep-engine
        2.x tapconnection.cc ``checkDumpOrTakeOverCompletion``); a vbucket it no
        longer had was skipped (``registerCursor``: "not found for TAP cursor.
        Skip it") and the connection stayed, sending NOOPs while idle. So does
        this one once every vbucket ended and one was lost (refused, or ended
        upstream for a reason other than OK); a dump, a takeover or a push
        closes as before, and so does a connection whose every stream was
        served to its end."""
        plan = self.plan
        if plan.dump or plan.takeover or self.closing_messages:
            return False
        return self.streams.any_lost

    async def _stay_open(self) -> None:
        """Every vbucket is gone upstream: close the upstream, then serve the TAP
        peer (its acks, NOOPs while idle) until it closes, which ends the session."""
        await self.peer.flush()
        log.warning(
            "%s: every vbucket's upstream stream ended (lost: %s); the TAP connection "
            "stays open, idle, until the client closes it, as a 2.x producer's did",
            self.name,
            ", ".join(map(str, self.streams.lost_vbuckets)),
        )
        if self.upstream is not None:
            await self.upstream.aclose()
            self._attach(None)
        await trio.sleep_forever()

    def _opening_messages(self) -> list[TapStreamMessage]:
        out: list[TapStreamMessage] = []
        if self.plan.support_ack:
            out.append(TapOpaque(OpaqueCode.ENABLE_AUTO_NACK))
        if self.plan.has(ConnectFlags.CHECKPOINT):
            out.append(TapOpaque(OpaqueCode.ENABLE_CHECKPOINT_SYNC))
        return out

    async def _connect(self) -> UprUpstream:
        config = self.config
        host, port = config.upstream
        # A new generation before the attempt: what was gathered for the lost
        # connection settles on the TAP side only.
        self.peer.settlements.new_upstream()
        upstream = await UprUpstream.connect(
            host,
            port,
            name=b"tapfront:" + self.name.encode(),
            dialect=config.dialect,
            buffer_size=config.buffer_size,
            noop_interval=config.upstream_noop_interval,
            user=config.user,
            password=config.password,
            ssl_context=config.ssl_context,
        )
        self.stats.buffer_size = upstream.window.buffer_size
        self._attach(upstream)
        return upstream

    def _attach(self, upstream: UprUpstream | None) -> None:
        self.upstream = self.peer.upstream = self.streams.upstream = upstream

    async def _upstream_lost(self, exc: UprUpstreamError, failures: int) -> None:
        """Flush what was translated, then wait before the next attempt."""
        attempts = self.config.reconnect_attempts
        await self.peer.flush()
        if self.upstream is not None:
            await self.upstream.aclose()
            self._attach(None)
            self.gateway_stats.upstream_reconnects_total[self.stats.upstream] += 1
        if attempts is not None and failures > attempts:
            raise SessionFailed(f"{self.name}: giving up on the UPR upstream: {exc}")
        delay = min(self.config.reconnect_max, self.config.reconnect_initial * 2 ** (failures - 1))
        # One warning a minute per client while the upstream stays down, not one per retry.
        level, note = self._retry_log.level(str(exc))
        log.log(level, "%s: %s; reconnecting in %.1fs%s", self.name, exc, delay, note)
        self.streams.lost()
        await trio.sleep(delay)
