"""A classic 2.x TAP client's bytes: what ep-engine's management/tap.py sends.

Every CONNECT and ack is built byte by byte as the classic 2.x Python client
sends it (ep-engine management/tap.py ``TapConnection._createTapCall`` and
``_encodeOpts``; mc_bin_server.py ``MemcachedBinaryChannel.handle_read`` for
the replies), not through the project's encoder, so a misreading the encoder
shares with a server cannot pass.
"""

from __future__ import annotations

import struct

from adapters.mcbp import Frame
from adapters.tap import ConnectFlags, TapOpcode

F = ConnectFlags
HEADER = struct.Struct(">BBHBBHIIQ")
EXTRA_HDR_SIZES = {0x41: 16, 0x42: 8, 0x43: 8, 0x44: 8, 0x45: 8}
"""memcacheConstants.EXTRA_HDR_SIZES for the TAP opcodes (checkpoints: absent, 0)."""
TAP_OPCODES = frozenset(op.value for op in TapOpcode if op != TapOpcode.CONNECT)


def classic_connect(name: bytes, opts: dict[int, object]) -> bytes:
    """tap.py's CONNECT: flags OR'ed in sorted order, each option's data in that
    order (backfill ">Q", a vbucket list "!H" count then "!H" each, any other
    option its raw string, most often '')."""
    flags = 0
    parts = []
    for op in sorted(opts):
        flags |= op
        data = opts[op]
        if op == F.BACKFILL:
            parts.append(struct.pack(">Q", data))
        elif op == F.LIST_VBUCKETS:
            vbs = list(data)  # type: ignore[call-overload]
            parts.append(struct.pack("!H", len(vbs)) + b"".join(struct.pack("!H", v) for v in vbs))
        else:
            parts.append(data)  # type: ignore[arg-type]
    extra = struct.pack(">I", flags)
    value = b"".join(parts)
    header = HEADER.pack(0x80, 0x40, len(name), len(extra), 0, 0, len(name) + 4 + len(value), 0, 0)
    return header + extra + name + value


def classic_reply(frame: Frame, status: int = 0, text: bytes = b"") -> bytes:
    """mc_bin_server's reply to a message: the request's opcode, key length and
    opaque, the opcode's extras length, a body of just the text (none for an ack)."""
    extlen = EXTRA_HDR_SIZES.get(frame.opcode, 0)
    header = HEADER.pack(
        0x81, frame.opcode, frame.key_length, extlen, 0, status, len(text), frame.opaque, 0
    )
    return header + text


def asks_for_ack(frame: Frame) -> bool:
    return frame.opcode in TAP_OPCODES and bool(struct.unpack_from(">H", frame.body, 2)[0] & 1)
