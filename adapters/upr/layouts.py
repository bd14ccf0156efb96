"""Struct layouts both dialects share (the differing ones live in ``dialect``)."""

from __future__ import annotations

import struct

U8 = struct.Struct(">B")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
OPEN_EXTRAS = struct.Struct(">II")
"""OPEN: reserved (seqno) u32, flags u32."""
SNAPSHOT_EXTRAS = struct.Struct(">QQI")
"""SNAPSHOT_MARKER: start seqno u64, end seqno u64, flags u32."""
