"""How a command connection becomes a UPR one: its first UPR request, without I/O.

Theory of operation. A listener's command door hands the first request
whose opcode is UPR's to ``open_connection``, which decides by the
request's class (``_OPENERS``, one table), never by its name:

- OPEN with the producer flag (0x01): a producer connection under the
  OPEN's name; the I/O side answers the OPEN (``Opening.reply``) once the
  connection runs, so a namesake is replaced before the consumer hears OK;
- OPEN with the notifier flag (0x02) alone: a producer connection too,
  whose streams only tell when their vbucket passes their start (``flags``
  says which; ep-engine 3.0 ep_engine.cc ``uprOpen`` tests PRODUCER first,
  then NOTIFIER, and makes both a ``UprProducer``);
- OPEN with neither: a consumer connection where the role has one (the
  reference node's; ``consumers``), else NOT_SUPPORTED;
- STREAM_REQ or GET_FAILOVER_LOG in a dialect without OPEN (the pre-release
  draft): a producer connection named after the peer's address, which then
  handles that request (``Opening.first``);
- any other UPR request (and, in the released dialect, STREAM_REQ or
  GET_FAILOVER_LOG): closed without a reply, "<NAME> needs an open UPR
  connection" (3.0 ``ENGINE_DISCONNECT``);
- a frame that does not decode: its error reply, then the connection
  closes (``Opening.closing``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Status, error_response
from adapters.upr.codec import decode_frame, encode
from adapters.upr.constants import Command, OpenFlags
from adapters.upr.dialect import Dialect
from adapters.upr.events import GetFailoverLog, Open, StreamRequest, UprEvent
from adapters.upr.responses import Response

NO_FLAGS = OpenFlags(0)


class Role(enum.Enum):
    PRODUCER = "producer"
    CONSUMER = "consumer"


@dataclass(frozen=True)
class Opening:
    """What the first UPR request makes of a connection (``role`` None: refused)."""

    role: Role | None
    reply: bytes = b""
    """Refused: the answer to send now. Opened: the OPEN's OK, to send once running."""
    closing: ProtocolError | None = None
    """Refused because the frame did not decode: close after the reply."""
    name: str = ""
    flags: OpenFlags = NO_FLAGS
    opened: Open | None = None
    first: StreamRequest | GetFailoverLog | None = None
    """The draft's first request, for the producer to handle."""


def open_connection(frame: Frame, dialect: Dialect, peer: str, *, consumers: bool) -> Opening:
    """What ``frame``, the connection's first UPR request, makes of the connection."""
    try:
        event = decode_frame(frame, dialect)
    except ProtocolError as exc:
        return Opening(None, error_response(frame, exc), closing=exc)
    opener = _OPENERS.get(type(event))
    if opener is None:
        return _unopened(event, dialect)
    return opener(event, dialect, peer, consumers)


def _open(event: Open, dialect: Dialect, _peer: str, consumers: bool) -> Opening:
    flags = event.flags
    if flags & (OpenFlags.PRODUCER | OpenFlags.NOTIFIER):
        role = Role.PRODUCER
    elif consumers:
        role = Role.CONSUMER
    else:
        return _refused(
            event, dialect, Status.NOT_SUPPORTED, "the gateway only serves producer connections"
        )
    name = event.name.decode("utf-8", "replace")
    ok = encode(Response(Command.OPEN, event.opaque, Status.SUCCESS.value), dialect)
    return Opening(role, ok, name=name, flags=flags, opened=event)


def notifies_only(flags: OpenFlags) -> bool:
    """OPEN flags of a notifier connection: NOTIFIER (0x02) without PRODUCER."""
    return bool(flags & OpenFlags.NOTIFIER) and not flags & OpenFlags.PRODUCER


def _draft_first(
    event: StreamRequest | GetFailoverLog, dialect: Dialect, peer: str, _consumers: bool
) -> Opening:
    if Command.OPEN in dialect.opcodes:
        return _unopened(event, dialect)
    # The draft has no OPEN, hence no name: the peer's address stands in.
    return Opening(Role.PRODUCER, name=f"upr-draft:{peer}", first=event)


def _unopened(event: UprEvent, dialect: Dialect) -> Opening:
    # ep-engine 3.0 ep_engine.cc: each UPR entry point finds no connection
    # handler before OPEN and returns ENGINE_DISCONNECT; memcached closes
    # without a reply.
    opcode = dialect.opcodes[getattr(event, "COMMAND", Command.OPEN)]
    error = ProtocolError(
        f"{event.NAME} needs an open UPR connection",
        opcode=opcode,
        field="opcode",
        value=opcode,
        offset=1,
    )
    return Opening(None, closing=error)


def _refused(event: UprEvent, dialect: Dialect, status: int, text: str) -> Opening:
    command = getattr(event, "COMMAND", Command.OPEN)
    return Opening(None, encode(Response(command, event.opaque, status, text.encode()), dialect))


_OPENERS: dict[type, Callable[[UprEvent, Dialect, str, bool], Opening]] = {
    Open: _open,  # type: ignore[dict-item]
    StreamRequest: _draft_first,  # type: ignore[dict-item]
    GetFailoverLog: _draft_first,  # type: ignore[dict-item]
}
"""What each first request may make of a connection."""
