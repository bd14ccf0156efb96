"""Memcached responses every role here builds alike.

A response repeats the request's opcode and opaque; an error response's
value is text saying what was wrong, as memcached's are. A refusal that
closes the connection is queued and seen out (for at most
``REFUSAL_FLUSH_SECONDS``, so a peer that does not read cannot hold the
close up) before the caller raises.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import trio

from adapters.mcbp import Frame, Magic, Status, encode_frame

REFUSAL_FLUSH_SECONDS = 2.0


class Sender(Protocol):
    def send_nowait(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


def reply(
    frame: Frame,
    status: int = Status.SUCCESS,
    *,
    key: bytes = b"",
    value: bytes = b"",
    extras: bytes = b"",
    cas: int = 0,
) -> bytes:
    """A response to ``frame`` (same opcode and opaque)."""
    return encode_frame(
        Magic.RESPONSE,
        frame.opcode,
        vbucket_or_status=status,
        opaque=frame.opaque,
        cas=cas,
        key=key,
        value=value,
        extras=extras,
    )


def error_reply(frame: Frame, status: int, text: str) -> bytes:
    """An error response to ``frame`` whose value says what was wrong."""
    return reply(frame, status, value=text.encode())


def stat_reply(frame: Frame, pairs: Iterable[tuple[str, str]]) -> bytes:
    """A STAT answer: one response per pair, then the empty one that ends it."""
    out = [reply(frame, key=k.encode(), value=v.encode()) for k, v in pairs]
    out.append(reply(frame))
    return b"".join(out)


async def send_refusal(conn: Sender, data: bytes) -> None:
    """Queue a refusal and see it out before the caller raises (which closes)."""
    conn.send_nowait(data)
    with trio.move_on_after(REFUSAL_FLUSH_SECONDS):  # a peer that does not read gets none
        await conn.drain()
