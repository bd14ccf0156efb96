"""Plain memcached commands of the reference node.

GET, SET, ADD, REPLACE, DELETE (with CAS), TOUCH, NOOP, VERSION, QUIT,
STAT, SASL (PLAIN), SET_VBUCKET/GET_VBUCKET, DEREGISTER_TAP_CLIENT, and one
node-only admin command, FAILOVER, that adds a failover-log entry to a
vbucket as a real failover would. Unknown opcodes get UNKNOWN_COMMAND and a
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
from gateway.auth import TooManyFailures
from gateway.node import stats
from gateway.node.server import VERSION, Node, Session, error_response, response
from gateway.wire import PacketConnection

NODE_FAILOVER = 0xF1
"""Reference-node admin command: new failover-log entry for the header's vbucket."""

RELATIVE_EXPIRY_LIMIT = 30 * 24 * 3600
"""memcached: expirations up to 30 days are relative to now, larger ones absolute."""

_STORE_EXTRAS = struct.Struct(">II")
_U32 = struct.Struct(">I")

Handler = Callable[[Node, Session, PacketConnection, Frame], Awaitable[None]]


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


async def _get(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=0, key=True)
    item = node.store.get(frame.vbucket_or_status, frame.key, time.time())
    await conn.send(response(frame, extras=_U32.pack(item.flags), value=item.value, cas=item.cas))


async def _store(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
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
    await conn.send(response(frame, cas=item.cas))


async def _delete(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=0, key=True)
    item = node.store.delete(frame.vbucket_or_status, frame.key, cas=frame.cas, now=time.time())
    await conn.send(response(frame, cas=item.cas))


async def _touch(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    _require(frame, extras=4, key=True)
    now = time.time()
    expiration = absolute_expiry(_U32.unpack(frame.extras)[0], now)
    item = node.store.touch(frame.vbucket_or_status, frame.key, expiration, now=now)
    await conn.send(response(frame, cas=item.cas))


async def _noop(_n: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    await conn.send(response(frame))


async def _version(_n: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    await conn.send(response(frame, value=VERSION.encode()))


async def _stat(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    group = frame.key.decode("utf-8", "replace")
    try:
        pairs = stats.collect(node, group)
    except stats.StatError as exc:
        await conn.send(error_response(frame, exc.status, str(exc)))
        return
    parts = [response(frame, key=k.encode(), value=v.encode()) for k, v in pairs]
    parts.append(response(frame))
    await conn.send(b"".join(parts))


async def _sasl_list(_n: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    await conn.send(response(frame, value=b"PLAIN"))


async def _sasl_auth(_n: Node, session: Session, conn: PacketConnection, frame: Frame) -> None:
    outcome = await session.auth.authenticate(frame)
    if outcome.user is None:
        await conn.send(error_response(frame, Status.AUTH_ERROR, outcome.message))
        if outcome.closing is not None:
            raise outcome.closing
        return
    session.authenticated = True
    conn.streaming()
    await conn.send(response(frame, value=b"Authenticated"))


def _admin_refusal(session: Session, frame: Frame, what: str) -> bytes | None:
    """The NO_ACCESS answer when ``what`` needs an admin and the user is not one."""
    if session.auth.may_administer():
        return None
    return error_response(frame, Status.NO_ACCESS, session.auth.refuse_admin(what))


async def _sasl_step(_n: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    await conn.send(error_response(frame, Status.AUTH_ERROR, "PLAIN needs no step"))


async def _set_vbucket(node: Node, session: Session, conn: PacketConnection, frame: Frame) -> None:
    if (denied := _admin_refusal(session, frame, "SET_VBUCKET")) is not None:
        await conn.send(denied)
        return
    _require(frame, extras=4, key=False)
    raw = _U32.unpack(frame.extras)[0]
    try:
        state = VBucketState(raw)
    except ValueError:
        raise _malformed(frame, f"unknown vbucket state {raw}") from None
    node.store.set_state(frame.vbucket_or_status, state, now=time.time())
    await conn.send(response(frame))


async def _get_vbucket(node: Node, _s: Session, conn: PacketConnection, frame: Frame) -> None:
    state = node.store.state(frame.vbucket_or_status)
    await conn.send(response(frame, value=_U32.pack(int(state))))


async def _deregister(node: Node, session: Session, conn: PacketConnection, frame: Frame) -> None:
    if (denied := _admin_refusal(session, frame, "DEREGISTER_TAP_CLIENT")) is not None:
        await conn.send(denied)
        return
    if node.tap.deregister(frame.key):
        await conn.send(response(frame))
    else:
        await conn.send(error_response(frame, Status.KEY_NOT_FOUND, "no such registered client"))


async def _failover(node: Node, session: Session, conn: PacketConnection, frame: Frame) -> None:
    if (denied := _admin_refusal(session, frame, "FAILOVER")) is not None:
        await conn.send(denied)
        return
    node.store.failover(frame.vbucket_or_status, now=time.time())
    await conn.send(response(frame))


HANDLERS: dict[int, Handler] = {
    Opcode.GET: _get,
    Opcode.SET: _store,
    Opcode.ADD: _store,
    Opcode.REPLACE: _store,
    Opcode.DELETE: _delete,
    Opcode.TOUCH: _touch,
    Opcode.NOOP: _noop,
    Opcode.VERSION: _version,
    Opcode.STAT: _stat,
    Opcode.SASL_LIST_MECHS: _sasl_list,
    Opcode.SASL_AUTH: _sasl_auth,
    Opcode.SASL_STEP: _sasl_step,
    Opcode.SET_VBUCKET: _set_vbucket,
    Opcode.GET_VBUCKET: _get_vbucket,
    Opcode.DEREGISTER_TAP_CLIENT: _deregister,
    NODE_FAILOVER: _failover,
}


async def execute(node: Node, session: Session, conn: PacketConnection, frame: Frame) -> None:
    """Run one command and answer it; errors become error responses."""
    if frame.opcode == Opcode.QUIT:
        raise QuitRequested
    handler = HANDLERS.get(frame.opcode)
    if handler is None:
        await conn.send(
            error_response(frame, Status.UNKNOWN_COMMAND, f"unknown command 0x{frame.opcode:02x}")
        )
        return
    try:
        await handler(node, session, conn, frame)
    except TooManyFailures:
        raise  # closes the connection
    except ProtocolError as exc:
        await conn.send(error_response(frame, exc.status or Status.INVALID_ARGUMENTS, str(exc)))
    except GatewayError as exc:
        status = getattr(exc, "status", None)
        if status is None:
            raise
        await conn.send(error_response(frame, int(status), str(exc)))


class QuitRequested(Exception):
    """QUIT: the client asked the server to close the connection."""
