"""The 24-byte memcached binary header and an incremental frame reader.

Header (big-endian): magic u8, opcode u8, key length u16, extras length u8,
datatype u8, vbucket (request) or status (response) u16, total body u32,
opaque u32, cas u64. Body = extras, key, value.

``FrameReader`` is fed arbitrary chunks with ``receive_data`` and hands out
whole frames with ``next_frame``; ``None`` means it needs more bytes. A
declared body larger than the configured maximum is rejected from the header
alone, before anything is buffered for it.

Requests are strict: extras and key must fit in the body. Responses from a
TAP peer are not, where ``lenient_responses`` is set: memcached 2.x framed a
TAP response by its total body length alone and read nothing but opcode,
opaque and status from its header (daemon/memcached.c, ``try_read_command``,
``dispatch_bin_command``, ``process_bin_tap_ack``), and the classic 2.x
Python client (``mc_bin_server``) answers with the request's key length and
the opcode's extras length over an empty body. Such a response is the header
plus its body; its key and extras lengths are read as 0, so the whole body
is its value.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from adapters.errors import ProtocolError
from adapters.mcbp.constants import HEADER_SIZE, Magic, Status

DEFAULT_MAX_FRAME_SIZE = 20 * 1024 * 1024
"""Largest body accepted by default: a 20 MiB item plus metadata is the memcached limit."""

HEADER = struct.Struct(">BBHBBHIIQ")
_BODY_LENGTH = struct.Struct(">I")
_REQUEST = Magic.REQUEST.value
_RESPONSE = Magic.RESPONSE.value


class Frame(NamedTuple):
    """One framed packet: the header fields and the body, copied once.

    ``vbucket_or_status`` is the vbucket of a request, the status of a
    response. ``extras``/``key``/``value`` slice the body by the header's
    lengths; TAP, whose engine-specific bytes sit between extras and key,
    slices ``body`` itself. A tuple, not a dataclass: it is built once per
    packet on the hot path. The codecs decode it into events; the command
    door (``gateway.io.door``) and the fast paths read it directly.
    """

    magic: int
    opcode: int
    key_length: int
    extras_length: int
    datatype: int
    vbucket_or_status: int
    opaque: int
    cas: int
    body: bytes

    @property
    def is_request(self) -> bool:
        return self.magic == _REQUEST

    @property
    def extras(self) -> bytes:
        return self.body[: self.extras_length]

    @property
    def key(self) -> bytes:
        return self.body[self.extras_length : self.extras_length + self.key_length]

    @property
    def value(self) -> bytes:
        return self.body[self.extras_length + self.key_length :]

    @property
    def size(self) -> int:
        """Bytes on the wire, header included (what flow control counts)."""
        return HEADER_SIZE + len(self.body)


def encode_frame(
    magic: int,
    opcode: int,
    vbucket_or_status: int = 0,
    opaque: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    cas: int = 0,
    datatype: int = 0,
    extras_length: int | None = None,
) -> bytes:
    """Serialise one packet.

    The fields may be given by position (the UPR encoders do, once an event:
    keywords cost a fifth of an item's encoding). ``extras_length`` overrides
    the header's extras length for TAP, whose engine-specific bytes follow the
    extras but are not counted in it.
    """
    header = HEADER.pack(
        magic,
        opcode,
        len(key),
        len(extras) if extras_length is None else extras_length,
        datatype,
        vbucket_or_status,
        len(extras) + len(key) + len(value),
        opaque,
        cas,
    )
    return b"".join((header, extras, key, value))


def error_response(frame: Frame, exc: ProtocolError) -> bytes:
    """The answer to a request refused for ``exc`` (any opcode, TAP's or UPR's):
    the error's status, EINVAL when it names none, and its text as the value."""
    return encode_frame(
        Magic.RESPONSE,
        frame.opcode,
        vbucket_or_status=exc.status or Status.INVALID_ARGUMENTS,
        opaque=frame.opaque,
        value=str(exc).encode(),
    )


class FrameReader:
    """Incremental reader of memcached binary frames.

    ``consumed`` counts the bytes of every frame handed out so far, so a caller
    can name the stream offset of an error. ``lenient_responses``: frame
    responses by body length alone (see the module docstring); a reader that
    learns mid-stream that its peer speaks TAP may set it then.
    """

    __slots__ = ("_buffer", "_offset", "consumed", "lenient_responses", "max_frame_size")

    def __init__(
        self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *, lenient_responses: bool = False
    ) -> None:
        self.max_frame_size = max_frame_size
        self.lenient_responses = lenient_responses
        self._buffer = bytearray()
        self._offset = 0
        self.consumed = 0

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        # Drop what was consumed before growing, so the buffer holds at most
        # one partial frame plus the newest chunk.
        if self._offset:
            del self._buffer[: self._offset]
            self._offset = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet handed out as frames."""
        return len(self._buffer) - self._offset

    @property
    def buffer(self) -> bytearray:
        """The bytes received; those from ``offset`` on are not handed out yet. A caller
        that frames in place (a fast path over runs of frames) reads them here and
        says how far it took them with ``advance``."""
        return self._buffer

    @property
    def offset(self) -> int:
        return self._offset

    def advance(self, offset: int) -> None:
        """The bytes of ``buffer`` up to ``offset`` were taken as whole frames in place."""
        self.consumed += offset - self._offset
        self._offset = offset

    def pending_body_length(self) -> int | None:
        """The declared body length of the partial frame buffered (None: no whole header yet)."""
        if len(self._buffer) - self._offset < HEADER_SIZE:
            return None
        length: int = _BODY_LENGTH.unpack_from(self._buffer, self._offset + 8)[0]
        return length

    def next_frame(self) -> Frame | None:
        buf = self._buffer
        off = self._offset
        if len(buf) - off < HEADER_SIZE:
            return None
        (magic, opcode, keylen, extlen, datatype, vbs, bodylen, opaque, cas) = HEADER.unpack_from(
            buf, off
        )
        if magic != _REQUEST and magic != _RESPONSE:
            raise ProtocolError(
                "bad magic byte", opcode=opcode, field="magic", value=magic, offset=self.consumed
            )
        if bodylen > self.max_frame_size:
            raise ProtocolError(
                f"declared body exceeds the {self.max_frame_size}-byte frame limit",
                opcode=opcode,
                field="total_body",
                value=bodylen,
                offset=self.consumed + 8,
            )
        if extlen + keylen > bodylen:
            if magic == _RESPONSE and self.lenient_responses:
                keylen = extlen = 0
            else:
                raise ProtocolError(
                    "extras and key are longer than the total body",
                    opcode=opcode,
                    field="total_body",
                    value=bodylen,
                    offset=self.consumed + 8,
                )
        end = off + HEADER_SIZE + bodylen
        if len(buf) < end:
            return None
        frame = Frame(
            magic,
            opcode,
            keylen,
            extlen,
            datatype,
            vbs,
            opaque,
            cas,
            bytes(buf[off + HEADER_SIZE : end]),
        )
        self._offset = end
        self.consumed += HEADER_SIZE + bodylen
        return frame

    def take_buffered(self) -> bytes:
        """The bytes received and not yet handed out as frames, which leave the reader
        (a caller that goes on framing in place from there)."""
        rest = bytes(self._buffer[self._offset :])
        self._buffer.clear()
        self._offset = 0
        return rest

    def frames(self) -> list[Frame]:
        """Every whole frame now buffered."""
        out = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out
