"""Failover logs on the wire: (vbucket uuid u64, seqno u64) pairs, newest first.

Both the STREAM_REQ success response and the GET_FAILOVER_LOG response carry
one as their value. The codec checks only the framing (a whole number of
16-byte entries); how many entries and how wide a uuid may be (48 bits and 25
entries in 3.0) are the producer's business, not the wire's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from adapters.errors import ProtocolError
from adapters.mcbp.constants import HEADER_SIZE, Status

ENTRY = struct.Struct(">QQ")

FailoverEntries = tuple[tuple[int, int], ...]
"""A failover log as it travels: (uuid, seqno) pairs, newest first (the
vbucket's own, with its rules, is ``failover_log.FailoverLog``)."""


def encode_failover_log(pairs: Iterable[tuple[int, int]]) -> bytes:
    """Serialise (uuid, seqno) pairs, in the order given (newest first)."""
    pack = ENTRY.pack
    return b"".join([pack(uuid, seqno) for uuid, seqno in pairs])


def decode_failover_log(value: bytes, opcode: int, *, offset: int = HEADER_SIZE) -> FailoverEntries:
    """Parse a failover log value; ``offset`` is where the value starts in its packet."""
    if len(value) % ENTRY.size:
        raise ProtocolError(
            f"failover log of {len(value)} bytes is not a whole number of 16-byte entries",
            opcode=opcode,
            field="failover_log",
            value=len(value),
            offset=offset,
            status=Status.INVALID_ARGUMENTS.value,
        )
    return tuple(ENTRY.iter_unpack(value))
