"""``tap-upr-gateway decode``: a packet dissector for people debugging a stream.

Reads back-to-back memcached binary packets, names each one as TAP, UPR (in
the chosen dialect) or plain memcached, and prints one JSON object per packet.
On a malformed packet everything before it has been printed; the error names
the byte offset and what is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Iterator
from typing import Any, TextIO

from adapters import tap, upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, FrameReader, Magic, Opcode, Status
from adapters.mcbp.constants import status_name

_WHITESPACE = re.compile(rb"\s+")
_NOT_HEX = re.compile(rb"[^0-9A-Fa-f]")


class DecodeError(Exception):
    """The input is not a well-formed packet stream; ``offset`` is where it broke."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


def parse_hex(text: bytes) -> bytes:
    """Hex text to bytes, whitespace ignored (and an optional 0x per token)."""
    cleaned = _WHITESPACE.sub(b"", text.replace(b"0x", b"").replace(b"0X", b""))
    bad = _NOT_HEX.search(cleaned)
    if bad is not None:
        char = cleaned[bad.start() : bad.start() + 1]
        raise DecodeError(
            f"input is not hex text: {char!r} is not a hex digit "
            f"(hex digit {bad.start()}, whitespace and 0x prefixes not counted)",
            bad.start() // 2,
        )
    if len(cleaned) % 2:
        raise DecodeError(
            f"hex text has an odd number of digits ({len(cleaned)}): the last byte is cut short",
            len(cleaned) // 2,
        )
    return bytes.fromhex(cleaned.decode("ascii"))


def looks_like_hex_text(data: bytes) -> bool:
    """Raw input that is really hex text (``--hex`` forgotten): only hex digits and spaces."""
    sample = _WHITESPACE.sub(b"", data[:4096])
    return len(sample) >= 2 and _NOT_HEX.search(sample) is None


def render_bytes(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + raw.hex()


def _render(value: Any) -> Any:
    if isinstance(value, bytes):
        return render_bytes(value)
    if isinstance(value, enum.IntFlag):
        return int(value)
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, tuple | list):
        return [_render(item) for item in value]
    return value


def _header(frame: Frame, protocol: str, opcode_name: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "protocol": protocol,
        "opcode": opcode_name,
        "magic": "request" if frame.magic == Magic.REQUEST else "response",
    }
    if frame.magic == Magic.REQUEST:
        out["vbucket"] = frame.vbucket_or_status
    else:
        out["status"] = frame.vbucket_or_status
        out["status_name"] = status_name(frame.vbucket_or_status)
    out["opaque"] = frame.opaque
    out["cas"] = frame.cas
    return out


def _event_record(frame: Frame, protocol: str, event: Any) -> dict[str, Any]:
    # A response event names the command it answers in a field of its own.
    command = getattr(event, "opcode", None) or getattr(event, "command", None)
    name = command.name if isinstance(command, enum.Enum) else event.NAME
    out = _header(frame, protocol, name)
    for field in dataclasses.fields(event):
        if field.name in ("opcode", "command"):
            continue
        out.setdefault(field.name, _render(getattr(event, field.name)))
    if isinstance(event, tap.TapConnect):
        out["connect_flag_names"] = [
            str(f.name).lower() for f in tap.ConnectFlags if f in event.connect_flags
        ]
    return out


def _plain_record(frame: Frame) -> dict[str, Any]:
    try:
        name = Opcode(frame.opcode).name
    except ValueError:
        name = f"0x{frame.opcode:02x}"
    out = _header(frame, "mcbp", name)
    out["datatype"] = frame.datatype
    out["extras"] = "hex:" + frame.extras.hex()
    out["key"] = render_bytes(frame.key)
    out["value"] = render_bytes(frame.value)
    return out


def describe(frame: Frame, dialect: upr.Dialect) -> dict[str, Any]:
    """One packet as a JSON-ready dict. Raises ``ProtocolError`` when malformed."""
    if tap.is_tap_opcode(frame.opcode) and frame.opcode != Opcode.NOOP:
        return _event_record(frame, "tap", tap.decode_frame(frame))
    try:
        event = upr.decode_frame(frame, dialect)
    except ProtocolError as exc:
        if exc.status != Status.UNKNOWN_COMMAND:
            raise
        return _plain_record(frame)
    return _event_record(frame, "upr", event)


def dissect(data: bytes, dialect: upr.Dialect) -> Iterator[dict[str, Any]]:
    """Yield a record per packet; raise ``DecodeError`` where the stream breaks."""
    reader = FrameReader()
    reader.receive_data(data)
    while True:
        start = reader.consumed
        try:
            frame = reader.next_frame()
        except ProtocolError as exc:
            raise DecodeError(str(exc), exc.offset if exc.offset is not None else start) from None
        if frame is None:
            break
        try:
            yield describe(frame, dialect)
        except ProtocolError as exc:
            located = exc.at(start)
            raise DecodeError(str(located), located.offset or start) from None
    if reader.buffered:
        raise DecodeError(
            f"truncated packet: {reader.buffered} trailing bytes do not make a whole packet",
            reader.consumed,
        )


def run(data: bytes, dialect_name: str, out: TextIO, err: TextIO) -> int:
    """Print every packet; return the exit status (0 ok, 2 malformed input)."""
    dialect = upr.get_dialect(dialect_name)
    try:
        for record in dissect(data, dialect):
            out.write(json.dumps(record) + "\n")
    except DecodeError as exc:
        out.flush()
        hint = " (the input looks like hex text: pass --hex)" if looks_like_hex_text(data) else ""
        err.write(f"decode: malformed input at byte offset {exc.offset}: {exc}{hint}\n")
        return 2
    return 0
