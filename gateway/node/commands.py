"""Plain memcached commands of the reference node.

GET, SET, ADD, REPLACE, DELETE (with CAS), TOUCH, QUIT,
SET_VBUCKET/GET_VBUCKET, DEREGISTER_TAP_CLIENT, and one node-only admin
command, FAILOVER, that adds a failover-log entry to a vbucket as a real
failover would. NOOP, VERSION, STAT and SASL (CRAM-MD5, PLAIN) are the command door's
(``gateway.io.door``), as on every listener here. Unknown opcodes get UNKNOWN_COMMAND and a
malformed known command INVALID_ARGUMENTS with a message; the connection
stays open in both cases, as memcached's does.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Awaitable, Callable

from adapters.errors import GatewayError, ProtocolError
from adapters.mcbp import Frame, Opcode, Status
from adapters.mcbp.constants import VBucketState
from gateway.io.auth import Authenticator
from gateway.io.connection import PacketConnection
from gateway.io.door import unknown_command
from gateway.io.replies import error_reply, reply
from gateway.node.server import Node, QuitRequested

NODE_FAILOVER = 0xF1
"""Reference-node admin command: new failover-log entry for the header's vbucket."""

RELATIVE_EXPIRY_LIMIT = 30 * 24 * 3600
"""memcached: expirations up to 30 days are relative to now, larger ones absolute."""

_STORE_EXTRAS = struct.Struct(">II")
_U32 = struct.Struct(">I")

Handler = Callable[[Node, Authenticator, PacketConnection, Frame], Awaitable[None]]


def absolute_expiry(expiration: int, now: float) -> int:
    if expiration == 0 or expiration > RELATIVE_EXPIRY_LIMIT:
        return expiration
    return int(now) + expiration


def _malformed(frame: Frame, what: str) -> ProtocolError:
    return ProtocolError(what, opcode=frame.opcode, status=Status.INVALID_ARGUMENTS)


def _require(frame: Frame, *, extras: int, key: bool, value: bool = False) -> None:
    if frame.extras_length != extras:
        raise _malformed(frame, f"extras must be {extras} bytes, got {frame.extras_length}")
    if key and not frame.key_length:
        raise _malformed(frame, "key is required")
    if not value and len(frame.body) > frame.extras_length + frame.key_length:
        raise _malformed(frame, "this command takes no value")


async def _get(node: Node, _auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=0, key=True)
    item = node.store.get(frame.vbucket_or_status, frame.key, time.time())
    await conn.send(reply(frame, extras=_U32.pack(item.flags), value=item.value, cas=item.cas))


async def _store(node: Node, _auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=8, key=True, value=True)
    flags, expiration = _STORE_EXTRAS.unpack(frame.extras)
    now = time.time()
    store = node.store
    operation = {Opcode.SET: store.set, Opcode.ADD: store.add, Opcode.REPLACE: store.replace}[
        Opcode(frame.opcode)
    ]
    item = operation(
        frame.vbucket_or_status,
        frame.key,
        frame.value,
        flags=flags,
        expiration=absolute_expiry(expiration, now),
        cas=frame.cas,
        now=now,
    )
    await conn.send(reply(frame, cas=item.cas))


async def _delete(node: Node, _auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=0, key=True)
    item = node.store.delete(frame.vbucket_or_status, frame.key, cas=frame.cas, now=time.time())
    await conn.send(reply(frame, cas=item.cas))


async def _touch(node: Node, _auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=4, key=True)
    now = time.time()
    expiration = absolute_expiry(_U32.unpack(frame.extras)[0], now)
    item = node.store.touch(frame.vbucket_or_status, frame.key, expiration, now=now)
    await conn.send(reply(frame, cas=item.cas))


def _admin_refusal(auth: Authenticator, frame: Frame, what: str) -> bytes | None:
    """The NO_ACCESS answer when ``what`` needs an admin and the user is not one."""
    if auth.may_administer():
        return None
    return error_reply(frame, Status.NO_ACCESS, auth.refuse_admin(what))


async def _set_vbucket(
    node: Node, auth: Authenticator, conn: PacketConnection, frame: Frame
) -> None:
    if (denied := _admin_refusal(auth, frame, "SET_VBUCKET")) is not None:
        await conn.send(denied)
        return
    _require(frame, extras=4, key=False)
    raw = _U32.unpack(frame.extras)[0]
    try:
        state = VBucketState(raw)
    except ValueError:
        raise _malformed(frame, f"unknown vbucket state {raw}") from None
    node.store.set_state(frame.vbucket_or_status, state, now=time.time())
    await conn.send(reply(frame))


async def _get_vbucket(
    node: Node, _auth: Authenticator, conn: PacketConnection, frame: Frame
) -> None:
    state = node.store.state(frame.vbucket_or_status)
    await conn.send(reply(frame, value=_U32.pack(int(state))))


async def _deregister(
    node: Node, auth: Authenticator, conn: PacketConnection, frame: Frame
) -> None:
    if (denied := _admin_refusal(auth, frame, "DEREGISTER_TAP_CLIENT")) is not None:
        await conn.send(denied)
        return
    if node.tap.deregister(frame.key):
        await conn.send(reply(frame))
    else:
        await conn.send(error_reply(frame, Status.KEY_NOT_FOUND, "no such registered client"))


async def _failover(node: Node, auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    if (denied := _admin_refusal(auth, frame, "FAILOVER")) is not None:
        await conn.send(denied)
        return
    node.store.failover(frame.vbucket_or_status, now=time.time())
    await conn.send(reply(frame))


HANDLERS: dict[int, Handler] = {
    Opcode.GET: _get,
    Opcode.SET: _store,
    Opcode.ADD: _store,
    Opcode.REPLACE: _store,
    Opcode.DELETE: _delete,
    Opcode.TOUCH: _touch,
    Opcode.SET_VBUCKET: _set_vbucket,
    Opcode.GET_VBUCKET: _get_vbucket,
    Opcode.DEREGISTER_TAP_CLIENT: _deregister,
    NODE_FAILOVER: _failover,
}


async def execute(node: Node, auth: Authenticator, conn: PacketConnection, frame: Frame) -> None:
    """Run one command and answer it; errors become error responses."""
    if frame.opcode == Opcode.QUIT:
        raise QuitRequested
    handler = HANDLERS.get(frame.opcode)
    if handler is None:
        await unknown_command(conn, frame, auth)
        return
    try:
        await handler(node, auth, conn, frame)
    except ProtocolError as exc:
        await conn.send(error_reply(frame, exc.status or Status.INVALID_ARGUMENTS, str(exc)))
    except GatewayError as exc:
        status = getattr(exc, "status", None)
        if status is None:
            raise
        await conn.send(error_reply(frame, int(status), str(exc)))
