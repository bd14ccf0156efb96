"""The command door: what every listener here answers before a connection streams.

Theory of operation. An accepted connection starts as a memcached command
connection, as on a 2.x or 3.0 node, whatever it later becomes. ``Door.serve``
reads its requests in order:

- a response (any magic but a request's) closes the connection
  (``ProtocolError``, whose text the role chooses);
- until SASL succeeds (when the listener has users) only the
  ``open_opcodes`` are answered, and a SASL_STEP while a CRAM-MD5 challenge
  waits for it; anything else gets AUTH_ERROR ``authenticate first`` and
  the connection stays open;
- SASL_LIST_MECHS (``CRAM-MD5 PLAIN``), SASL_AUTH and SASL_STEP (checked by
  ``Authenticator``: AUTH_CONTINUE with the challenge, success or a refusal;
  too many failures close the connection), NOOP, VERSION and STAT are
  answered alike by every role; the role supplies its VERSION text and its STAT
  groups (a ``StatError`` becomes an error reply with its status);
- an opcode in the role's ``stream_opcodes`` goes to its ``begin_stream``
  hook, which either keeps the connection for the rest of its life (returns
  True: the door is done) or has answered the request itself (False: the
  door reads on);
- anything else goes to the role's ``command`` hook (UNKNOWN_COMMAND unless
  the role knows it).

A role whose commands carry items (the reference node's GET/SET) has
``full_frames``: once authenticated, its frames may be as large as a
stream's; the fronts' command connections stay at the command frame size.

Streams keep the door. memcached never stops being memcached on a TAP or
UPR connection: every packet a streaming connection receives goes through
the same command dispatcher (2.x and 3.0 daemon/memcached.c ``conn_ship_log``
runs ``try_read_command``, and ``conn_set_state`` sends a TAP/UPR connection
back to ``conn_ship_log`` where another would wait for its next command), so
STAT, VERSION, NOOP (0x0a), SASL and the role's ordinary commands are
answered between stream messages, and an opcode nobody knows gets
UNKNOWN_COMMAND with the stream going on. ``answer`` is that dispatcher for
a stream's reader: it answers a request the stream protocol does not own,
as the command connection did. A reply is one whole frame queued in one
send, so it lands between two stream messages, never inside one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass, field
from typing import Any

import trio

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, Opcode, Status
from gateway.io.auth import MECHANISMS, Authenticator, Users
from gateway.io.connection import PacketConnection
from gateway.io.limits import ConnectionLimits, ListenerCounters
from gateway.io.listen import serve_packets
from gateway.io.replies import error_reply, reply, stat_reply
from gateway.io.stat_replies import StatError

OPEN_OPCODES = frozenset(
    {Opcode.SASL_LIST_MECHS, Opcode.SASL_AUTH, Opcode.SASL_STEP, Opcode.NOOP, Opcode.VERSION}
)
"""What a connection may send before it has authenticated."""

Pairs = list[tuple[str, str]]
StatHook = Callable[[str], Awaitable[Pairs]]
StreamHook = Callable[[PacketConnection, Frame, Authenticator], Awaitable[bool]]
CommandHook = Callable[[PacketConnection, Frame, Authenticator], Awaitable[None]]
Answer = Callable[[PacketConnection, Frame], Awaitable[None]]
"""How a stream's reader has a request it does not own answered (``Door.answer``)."""


async def unknown_command(conn: PacketConnection, frame: Frame, _auth: Authenticator) -> None:
    await refuse_command(conn, frame)


async def refuse_command(conn: PacketConnection, frame: Frame) -> None:
    """UNKNOWN_COMMAND, the connection left open; the ``Answer`` of a stream with no
    door behind it (a connection we dialed)."""
    await conn.send(
        error_reply(frame, Status.UNKNOWN_COMMAND, f"unknown command 0x{frame.opcode:02x}")
    )


async def no_stream(_conn: PacketConnection, _frame: Frame, _auth: Authenticator) -> bool:
    return False


@dataclass
class Door:
    """One listener's command door (see the module docstring)."""

    label: str
    """The listener's name in logs and counters (``"node"``, ``"tap-front"``)."""
    users: Users | None
    limits: ConnectionLimits
    counters: ListenerCounters
    version: str
    """The VERSION answer."""
    stat: StatHook
    stream_opcodes: Container[int] = frozenset()
    begin_stream: StreamHook = no_stream
    command: CommandHook = unknown_command
    stray_response: str = "unexpected response on a command connection"
    """The error a response before any stream closes the connection with."""
    on_stray_response: Callable[[], None] = lambda: None
    open_opcodes: Container[int] = field(default=OPEN_OPCODES)
    full_frames: bool = False

    async def listen(
        self,
        host: str,
        port: int,
        *,
        handler: Callable[[PacketConnection], Awaitable[None]] | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
        **options: Any,
    ) -> None:
        """Serve the door on ``host:port`` (``serve_packets``, whose other options
        pass through); ``handler`` wraps ``serve`` where the role counts or ends
        connections itself; ``task_status`` gets the listeners."""
        await serve_packets(
            handler or self.serve,
            host,
            port,
            label=self.label,
            limits=self.limits,
            auth_required=self.users is not None,
            counters=self.counters,
            task_status=task_status,
            **options,
        )

    def authenticator(self, conn: PacketConnection) -> Authenticator:
        limits = self.limits
        auth = conn.authority = Authenticator(
            self.users,
            label=self.label,
            peer=conn.name.rpartition(" ")[2],
            counters=self.counters,
            max_failures=limits.max_auth_failures,
            failure_delay=limits.auth_failure_delay,
        )
        return auth

    async def serve(self, conn: PacketConnection) -> None:
        """Answer commands until the connection closes or becomes a stream."""
        auth = self.authenticator(conn)
        authenticated = self.users is None
        if authenticated and self.full_frames:
            conn.streaming()
        while (frame := await conn.receive_frame()) is not None:
            opcode = frame.opcode
            if frame.magic != Magic.REQUEST:
                self.on_stray_response()
                raise ProtocolError(
                    self.stray_response, opcode=opcode, field="magic", value=frame.magic
                )
            if (
                not authenticated
                and opcode not in self.open_opcodes
                and not (opcode == Opcode.SASL_STEP and auth.expecting_step)
            ):
                await conn.send(error_reply(frame, Status.AUTH_ERROR, "authenticate first"))
            elif opcode in _SASL:
                authenticated = await self._sasl_auth(conn, frame, auth) or authenticated
            elif opcode in self.stream_opcodes and opcode not in _COMMON:
                if await self.begin_stream(conn, frame, auth):
                    return
            else:
                await self.answer(conn, frame, auth)

    async def answer(
        self, conn: PacketConnection, frame: Frame, auth: Authenticator | None = None
    ) -> None:
        """Answer one request as a command connection does (see the module docstring);
        a stream's reader calls it for the requests its protocol does not own."""
        if auth is None:
            auth = conn.authority or self.authenticator(conn)
        common = _COMMON.get(frame.opcode)
        if common is not None:
            await common(self, conn, frame, auth)
        else:
            await self.command(conn, frame, auth)

    async def _mechanisms(self, conn: PacketConnection, frame: Frame, _auth: Authenticator) -> None:
        await conn.send(reply(frame, value=MECHANISMS))

    async def _noop(self, conn: PacketConnection, frame: Frame, _auth: Authenticator) -> None:
        await conn.send(reply(frame))

    async def _version(self, conn: PacketConnection, frame: Frame, _auth: Authenticator) -> None:
        await conn.send(reply(frame, value=self.version.encode()))

    async def _sasl(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> None:
        await self._sasl_auth(conn, frame, auth)

    async def _sasl_auth(self, conn: PacketConnection, frame: Frame, auth: Authenticator) -> bool:
        """SASL_AUTH or SASL_STEP; True once authenticated."""
        if frame.opcode == Opcode.SASL_STEP:
            outcome = await auth.step(frame)
        else:
            outcome = await auth.authenticate(frame)
        if outcome.challenge is not None:
            await conn.send(reply(frame, Status.AUTH_CONTINUE, value=outcome.challenge))
            return False
        if outcome.user is None:
            await conn.send(error_reply(frame, outcome.status, outcome.message))
            if outcome.closing is not None:
                raise outcome.closing
            return False
        if self.full_frames:
            conn.streaming()
        else:
            conn.authenticated()
        await conn.send(reply(frame, value=b"Authenticated"))
        return True

    async def _stat(self, conn: PacketConnection, frame: Frame, _auth: Authenticator) -> None:
        try:
            pairs = await self.stat(frame.key.decode("utf-8", "replace"))
        except StatError as exc:
            await conn.send(error_reply(frame, exc.status, str(exc)))
            return
        await conn.send(stat_reply(frame, pairs))


_COMMON: dict[int, Callable[[Door, PacketConnection, Frame, Authenticator], Awaitable[None]]] = {
    Opcode.SASL_AUTH: Door._sasl,
    Opcode.SASL_STEP: Door._sasl,
    Opcode.SASL_LIST_MECHS: Door._mechanisms,
    Opcode.NOOP: Door._noop,
    Opcode.VERSION: Door._version,
    Opcode.STAT: Door._stat,
}
"""What every role answers alike, by opcode."""
_SASL = frozenset({Opcode.SASL_AUTH, Opcode.SASL_STEP})
