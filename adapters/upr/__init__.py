"""UPR (released as DCP in Couchbase 3.0): events and codec, in two dialects.

``DCP`` is the released 3.0 wire format, ``UPR_DRAFT`` the transport draft
that peers older than about May 2014 speak; ``get_dialect`` maps the names
``"dcp"`` and ``"upr-draft"`` to them. Events are the same in both.
"""

from adapters.upr.codec import UprDecoder, decode_frame, encode
from adapters.upr.constants import (
    Command,
    OpenFlags,
    SnapshotFlags,
    StreamEndReason,
    StreamFlags,
    StreamState,
    VBucketState,
)
from adapters.upr.dialect import DCP, DIALECTS, UPR_DRAFT, Dialect, get_dialect
from adapters.upr.events import (
    REQUEST_CLASSES,
    AddStream,
    BufferAcknowledgement,
    CloseStream,
    Control,
    Deletion,
    Expiration,
    Flush,
    GetFailoverLog,
    Mutation,
    Noop,
    Open,
    SetVbucketState,
    SnapshotEnd,
    SnapshotMarker,
    SnapshotStart,
    StreamEnd,
    StreamRequest,
    StreamStart,
    UprEvent,
    UprRequest,
    UprResponse,
)
from adapters.upr.failover import FailoverEntries, decode_failover_log, encode_failover_log
from adapters.upr.failover_log import FailoverLog
from adapters.upr.items import ItemKind, StoredItem
from adapters.upr.responses import (
    AddStreamResponse,
    FailoverLogResponse,
    Response,
    StreamRequestOk,
    StreamRequestRollback,
)

__all__ = [
    "DCP",
    "DIALECTS",
    "REQUEST_CLASSES",
    "UPR_DRAFT",
    "AddStream",
    "AddStreamResponse",
    "BufferAcknowledgement",
    "CloseStream",
    "Command",
    "Control",
    "Deletion",
    "Dialect",
    "Expiration",
    "FailoverEntries",
    "FailoverLog",
    "FailoverLogResponse",
    "Flush",
    "GetFailoverLog",
    "ItemKind",
    "Mutation",
    "Noop",
    "Open",
    "OpenFlags",
    "Response",
    "SetVbucketState",
    "SnapshotEnd",
    "SnapshotFlags",
    "SnapshotMarker",
    "SnapshotStart",
    "StoredItem",
    "StreamEnd",
    "StreamEndReason",
    "StreamFlags",
    "StreamRequest",
    "StreamRequestOk",
    "StreamRequestRollback",
    "StreamStart",
    "StreamState",
    "UprDecoder",
    "UprEvent",
    "UprRequest",
    "UprResponse",
    "VBucketState",
    "decode_failover_log",
    "decode_frame",
    "encode",
    "encode_failover_log",
    "get_dialect",
]
