"""Draining a decoder fed arbitrary bytes, and checking what it took.

Both codecs (TAP, UPR) frame by the memcached binary header: 24 bytes with
the body length at offset 8. Whatever the bytes, a decoder either hands out
events, each from one whole frame, or stops for want of bytes with less
than a frame left, or raises ``ProtocolError`` naming a place inside the
frame it refused (an offset into the stream, not into the frame).
"""

from __future__ import annotations

from typing import Any, Protocol

from adapters.errors import ProtocolError

HEADER = 24


class Decoder(Protocol):
    @property
    def buffered(self) -> int: ...

    def next_event(self) -> Any: ...


def frame_ends(blob: bytes, count: int) -> int:
    """Where the first ``count`` frames of ``blob`` end, by their declared body lengths."""
    end = 0
    for _ in range(count):
        end += HEADER + int.from_bytes(blob[end + 8 : end + 12], "big")
    return end


def drain(decoder: Decoder, blob: bytes) -> list[Any]:
    """The events of ``blob`` (already fed to ``decoder``) until it needs more bytes
    or refuses a frame, checking the module docstring's promise either way."""
    events: list[Any] = []  # the decoder's own (mypy cannot infer them from a union)
    try:
        while (event := decoder.next_event()) is not None:
            events.append(event)
    except ProtocolError as exc:
        start = frame_ends(blob, len(events))
        assert exc.offset is not None and start <= exc.offset <= len(blob), (exc, start)
    else:
        consumed = len(blob) - decoder.buffered
        assert consumed == frame_ends(blob, len(events))
        declared = int.from_bytes(blob[consumed + 8 : consumed + 12], "big")
        assert decoder.buffered < HEADER or decoder.buffered < HEADER + declared
    return events
