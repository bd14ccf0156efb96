"""Captures: what a connection received or sent, as msgpack records in segment files.

``CaptureRecorder`` is what the fronts and the ``capture`` command call on
their hot paths; ``segments`` reads and writes the files; ``records``
defines one record. The ``verify`` job (``gateway.tools.verify``) reads them.

The recorder (trio) is imported on first use, so Spark executors that read
segments need neither trio nor the rest of the gateway's I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.tools.capture.records import (
    SCHEMA_VERSION,
    CaptureRecord,
    Kind,
    digest,
    item_record,
    marker_record,
)
from gateway.tools.capture.segments import (
    CaptureSegment,
    SegmentError,
    SegmentWriter,
    TornTail,
    decode_segment,
    list_segments,
    read_capture,
    read_segment,
)

__all__ = [
    "SCHEMA_VERSION",
    "CaptureRecord",
    "CaptureRecorder",
    "CaptureSegment",
    "Kind",
    "SegmentError",
    "SegmentWriter",
    "TornTail",
    "decode_segment",
    "digest",
    "item_record",
    "list_segments",
    "marker_record",
    "open_recorder",
    "read_capture",
    "read_segment",
]


if TYPE_CHECKING:
    from gateway.tools.capture.recorder import CaptureRecorder, open_recorder


def __getattr__(name: str) -> Any:
    if name in ("CaptureRecorder", "open_recorder"):
        from gateway.tools.capture import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
