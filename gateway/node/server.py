"""The reference node: one listener that speaks memcached, TAP and UPR.

Every connection starts as a memcached command connection (GET/SET/...,
STAT, SASL). Its first stream message decides what it becomes for the rest
of its life, as on a real node:

- TAP CONNECT: a TAP producer stream (``tap_producer``);
- a TAP stream message (MUTATION, DELETE, OPAQUE, ...): the connection is a
  TAP sender and this node its receiver (``tap_receiver``), the destination of
  a 2.x vbucket move;
- UPR OPEN with the producer flag: a UPR producer (``upr_producer``); with no
  flag: a UPR consumer whose streams this node requests (``upr_consumer``);
  in the upr-draft dialect, which has no OPEN, a STREAM_REQ or
  GET_FAILOVER_LOG starts a producer connection directly.

Background tasks close checkpoints on time and run the expiry pager.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from functools import partial

import trio

from adapters import tap, upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Status
from adapters.upr.opening import Role, open_connection
from gateway.io.auth import Authenticator, Users
from gateway.io.connection import ConnectionClosed, PacketConnection
from gateway.io.door import Door
from gateway.io.limits import ConnectionLimits, ListenerCounters
from gateway.io.replies import error_reply
from gateway.node.changes import ChangeFeed
from gateway.node.store import Store
from gateway.runtime import logs
from gateway.runtime.memory import TrimAfterCloses

log = logging.getLogger(__name__)

VERSION = "3.0.0-tap-upr-reference"
LABEL = "node"
_TAP_STREAM_OPCODES = frozenset(op for op in tap.TapOpcode if op != tap.TapOpcode.CONNECT)


@dataclass
class NodeConfig:
    vbuckets: int = 64
    dialect: str = "dcp"
    users: Users | dict[str, str] | None = None
    """SASL PLAIN credentials; when set, every command but SASL/NOOP/VERSION needs them."""
    limits: ConnectionLimits = field(
        default_factory=lambda: ConnectionLimits(command_idle_timeout=None)
    )
    """A memcached command connection may stay idle: only authentication is timed."""
    ssl_context: ssl.SSLContext | None = None
    tap_ack_interval: int = 1000
    tap_max_unacked: int = 10_000
    tap_backoff: float = 5.0
    tap_noop_interval: float = 20.0
    tap_ack_grace_period: float = 300.0
    """Seconds a support-ack client's full window may go without an ack (2.x's default)."""
    tap_wait_control_acks: bool = False
    """Hold items until OPAQUE and checkpoint messages are acked, as 2.x did (tap_producer)."""
    upr_noop_interval: float = 180.0
    expiry_interval: float = 1.0
    checkpoint_interval: float = 1.0
    max_frame_size: int = 20 * 1024 * 1024


class QuitRequested(ConnectionClosed):
    """QUIT: the client asked the server to close the connection (on a stream too,
    where it ends the stream as a closed connection does)."""


class Node:
    def __init__(self, store: Store, config: NodeConfig | None = None) -> None:
        from gateway.node.tap_producer import TapHub
        from gateway.node.upr_producer import UprHub

        self.store = store
        self.config = config or NodeConfig()
        self.dialect = upr.get_dialect(self.config.dialect)
        self.changes = ChangeFeed()
        store.add_listener(self.changes.notify)
        self.tap = TapHub(self)
        self.upr = UprHub(self)
        self.started_at = trio.current_time() if _in_trio() else 0.0
        self.connections = 0
        self.users = Users.of(self.config.users)
        self.listener_counters = ListenerCounters()
        self.trimmer = TrimAfterCloses()
        """Gives the heap of closed connections (their outboxes) back to the system."""
        self.door = Door(
            LABEL,
            self.users,
            self.config.limits,
            self.listener_counters,
            VERSION,
            self._stat,
            stream_opcodes=frozenset(
                {tap.TapOpcode.CONNECT, *_TAP_STREAM_OPCODES, *self.dialect.commands}
            ),
            begin_stream=self._become_stream,
            command=self._command,
            full_frames=True,  # memcached commands carry items: the full frame size
        )

    # -- serving -------------------------------------------------------------

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen and serve until cancelled; ``task_status`` gets the listeners."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._housekeeping)
            nursery.start_soon(self.trimmer.run)
            listeners = await nursery.start(
                partial(
                    self.door.listen,
                    host,
                    port,
                    handler=self.handle,
                    max_frame_size=self.config.max_frame_size,
                    ssl_context=self.config.ssl_context,
                )
            )
            task_status.started(listeners)

    async def handle(self, conn: PacketConnection) -> None:
        self.connections += 1
        try:
            await self.door.serve(conn)
        except QuitRequested:
            pass
        finally:
            self.connections -= 1

    async def _stat(self, group: str) -> list[tuple[str, str]]:
        from gateway.node import stat_groups

        return stat_groups.collect(self, group)

    async def _command(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> None:
        from gateway.node import commands

        await commands.execute(self, auth, conn, frame)

    async def _become_stream(
        self, conn: PacketConnection, frame: Frame, auth: Authenticator
    ) -> bool:
        """Hand the connection to the stream role ``frame`` starts; False when it
        was refused with an answer and the connection stays a command one."""
        from gateway.node.tap_producer import serve_tap_stream
        from gateway.node.tap_receiver import receive_tap_stream
        from gateway.node.upr_consumer import serve_upr_consumer
        from gateway.node.upr_producer import serve_upr_producer

        opcode = frame.opcode
        if opcode == tap.TapOpcode.CONNECT:
            try:
                connect = tap.decode_frame(frame)
            except ProtocolError as exc:
                await conn.send(error_reply(frame, Status.NOT_SUPPORTED, str(exc)))
                raise
            assert isinstance(connect, tap.TapConnect)
            takeover = connect.connect_flags & tap.ConnectFlags.TAKEOVER_VBUCKETS
            if takeover and not auth.may_administer():
                denied = auth.refuse_admin("TAP takeover")
                await conn.send(error_reply(frame, Status.NO_ACCESS, denied))
                return True
            logs.name_connection(connect.name.decode("utf-8", "replace"))
            await serve_tap_stream(self, conn, frame, connect)
            return True
        if opcode in _TAP_STREAM_OPCODES:
            await receive_tap_stream(self, conn, frame)
            return True
        opening = open_connection(frame, self.dialect, conn.name.rpartition(" ")[2], consumers=True)
        if opening.role is None:
            await conn.send(opening.reply)
            if opening.closing is not None:
                raise opening.closing
            return False
        serve = serve_upr_producer if opening.role is Role.PRODUCER else serve_upr_consumer
        await serve(self, conn, opening)
        return True

    # -- housekeeping --------------------------------------------------------

    async def _housekeeping(self) -> None:
        """Checkpoints closed on time, expired items turned into expirations."""
        store = self.store
        while True:
            await trio.sleep(min(self.config.expiry_interval, self.config.checkpoint_interval))
            now = wall_clock()
            store.maybe_close_checkpoints(now)
            store.expire(now)


def wall_clock() -> float:
    import time

    return time.time()


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True
