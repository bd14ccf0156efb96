"""UPR codec: frames to events, events to bytes, in either dialect.

Theory of operation (after hyperframe). Each dialect's decoder table (by
``magic << 8 | opcode``) and encoder table (by event class) is built once from
the dialect's data, the first time the dialect is used, and cached on the
dialect object's identity. ``decode_frame`` and ``encode`` are a lookup and a
call. ``UprDecoder`` adds the incremental framing of ``FrameReader``: feed it
bytes as they arrive, take events until it returns ``None``.

Errors. Bad input raises ``ProtocolError``: an opcode the dialect does not
have carries UNKNOWN_COMMAND (0x81), a malformed packet INVALID_ARGUMENTS
(0x04); ``decode_frame`` gives offsets from the packet start and
``UprDecoder`` from the start of the stream. After an error the stream is
unusable (the peer gets the status, if any, and the connection closes). An
event the dialect cannot carry raises ``LocalProtocolError`` from ``encode``.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from adapters.errors import LocalProtocolError, ProtocolError
from adapters.mcbp.constants import Status
from adapters.mcbp.frames import DEFAULT_MAX_FRAME_SIZE, Frame, FrameReader
from adapters.upr.checks import Decoder
from adapters.upr.decode_responses import build_decoders
from adapters.upr.dialect import DCP, Dialect
from adapters.upr.encoding import Encoder, build_encoders
from adapters.upr.events import UprEvent

__all__ = ["UprDecoder", "decode_frame", "encode"]


class _Tables(NamedTuple):
    decoders: dict[int, Decoder]
    encoders: dict[type, Encoder]


_TABLES: dict[Dialect, _Tables] = {}


def _tables(dialect: Dialect) -> _Tables:
    tables = _TABLES.get(dialect)
    if tables is None:
        tables = _TABLES[dialect] = _Tables(build_decoders(dialect), build_encoders(dialect))
    return tables


def _unknown_opcode(frame: Frame, dialect: Dialect) -> ProtocolError:
    kind = "request" if frame.is_request else "response"
    return ProtocolError(
        f"not a UPR {kind} opcode in the {dialect.name} dialect",
        opcode=frame.opcode,
        field="opcode",
        value=frame.opcode,
        offset=1,
        status=Status.UNKNOWN_COMMAND.value,
    )


def decode_frame(frame: Frame, dialect: Dialect = DCP) -> UprEvent:
    """Decode one frame; raises ``ProtocolError`` with offsets within the packet."""
    decoder = _tables(dialect).decoders.get(frame[0] << 8 | frame[1])
    if decoder is None:
        raise _unknown_opcode(frame, dialect)
    return decoder(frame)


def encode(event: UprEvent, dialect: Dialect = DCP) -> bytes:
    """Serialise one event; ``LocalProtocolError`` if the dialect cannot carry it."""
    encoder = _tables(dialect).encoders.get(type(event))
    name = getattr(type(event), "NAME", type(event).__name__)
    if encoder is None:
        raise LocalProtocolError(f"{name} has no message in the {dialect.name} dialect")
    try:
        return encoder(event)
    except struct.error as exc:
        # A number or length too large (or negative) for its wire field.
        raise LocalProtocolError(f"cannot encode {name}: {exc}") from None


class UprDecoder:
    """Incremental UPR decoder: ``receive_data`` bytes, take events with ``next_event``.

    ``next_event`` returns ``None`` when it needs more bytes. A declared body
    over ``max_frame_size`` is rejected from its header alone.
    """

    __slots__ = ("_decoders", "_reader", "dialect")

    def __init__(
        self, dialect: Dialect = DCP, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        self.dialect = dialect
        self._decoders = _tables(dialect).decoders
        self._reader = FrameReader(max_frame_size)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.receive_data(data)

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet make a whole packet."""
        return self._reader.buffered

    @property
    def consumed(self) -> int:
        """Bytes of every packet handed out so far: the stream offset of the next one."""
        return self._reader.consumed

    def next_event(self) -> UprEvent | None:
        reader = self._reader
        start = reader.consumed
        frame = reader.next_frame()
        if frame is None:
            return None
        decoder = self._decoders.get(frame[0] << 8 | frame[1])
        try:
            if decoder is None:
                raise _unknown_opcode(frame, self.dialect)
            return decoder(frame)
        except ProtocolError as exc:
            raise exc.at(start) from None

    def events(self) -> list[UprEvent]:
        """Every event the buffered bytes make."""
        out = []
        while (event := self.next_event()) is not None:
            out.append(event)
        return out
