"""Memcached binary protocol framing shared by TAP and UPR."""

from adapters.mcbp.constants import HEADER_SIZE, Magic, Opcode, Status
from adapters.mcbp.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    Frame,
    FrameReader,
    encode_frame,
    error_response,
)

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_SIZE",
    "Frame",
    "FrameReader",
    "Magic",
    "Opcode",
    "Status",
    "encode_frame",
    "error_response",
]
