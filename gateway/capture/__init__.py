"""Captures: what a connection received or sent, as msgpack records in segment files.

``CaptureRecorder`` is what the fronts and the ``capture`` command call on
their hot paths; ``segments`` reads and writes the files; ``records``
defines one record. The ``verify`` job (``gateway.verify``) reads them.
"""

from gateway.capture.recorder import CaptureRecorder, open_recorder
from gateway.capture.records import (
    SCHEMA_VERSION,
    CaptureRecord,
    Kind,
    digest,
    item_record,
    marker_record,
)
from gateway.capture.segments import (
    Segment,
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
    "Kind",
    "Segment",
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
