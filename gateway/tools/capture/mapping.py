"""TAP messages and UPR events as capture records, for the capture command and the fronts.

``TapRecording`` and ``UprRecording`` each wrap a ``CaptureRecorder`` and
remember, per vbucket, the checkpoint or snapshot an item arrives in, so
every item record carries its boundary. ``record`` returns the kind it
recorded (``None`` for a message that is not an item or a boundary).
Item flags are recorded as stored: a TAP mutation without the
NETWORK_BYTE_ORDER flag carries them byte-swapped (2.x host order).
"""

from __future__ import annotations

from adapters import upr
from adapters.tap import (
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapEvent,
    TapFlags,
    TapMutation,
    TapOpaque,
)
from adapters.tap.item_messages import stored_flags
from gateway.tools.capture.recorder import CaptureRecorder
from gateway.tools.capture.records import Kind

_BACKFILL = {
    OpaqueCode.INITIAL_VBUCKET_STREAM: Kind.BACKFILL_START,
    OpaqueCode.CLOSE_BACKFILL: Kind.BACKFILL_END,
}


class TapRecording:
    def __init__(self, recorder: CaptureRecorder) -> None:
        self.recorder = recorder
        self.checkpoint: dict[int, int | None] = {}

    def record(self, event: TapEvent, arrival: float) -> Kind | None:
        recorder = self.recorder
        if isinstance(event, TapMutation):
            recorder.record_item(
                event.vbucket,
                event.key,
                Kind.MUTATION,
                by_seqno=None,
                rev_seqno=event.rev_seqno,
                cas=event.cas,
                flags=stored_flags(event),
                expiration=event.expiration,
                value=None if event.tap_flags & TapFlags.NO_VALUE else event.value,
                checkpoint_id=self.checkpoint.get(event.vbucket),
                arrival=arrival,
            )
            return Kind.MUTATION
        if isinstance(event, TapDelete):
            recorder.record_item(
                event.vbucket,
                event.key,
                Kind.DELETE,
                by_seqno=None,
                rev_seqno=event.rev_seqno,
                cas=event.cas,
                checkpoint_id=self.checkpoint.get(event.vbucket),
                arrival=arrival,
            )
            return Kind.DELETE
        if isinstance(event, TapCheckpointStart | TapCheckpointEnd):
            start = isinstance(event, TapCheckpointStart)
            kind = Kind.CHECKPOINT_START if start else Kind.CHECKPOINT_END
            self.checkpoint[event.vbucket] = event.checkpoint_id if start else None
            recorder.record_marker(
                event.vbucket, kind, checkpoint_id=event.checkpoint_id, arrival=arrival
            )
            return kind
        if isinstance(event, TapOpaque) and event.opaque_code in _BACKFILL:
            kind = _BACKFILL[OpaqueCode(event.opaque_code)]
            recorder.record_marker(event.vbucket, kind, arrival=arrival)
            return kind
        return None


class UprRecording:
    def __init__(self, recorder: CaptureRecorder, *, delete_kind: Kind = Kind.DELETION) -> None:
        self.recorder = recorder
        self.delete_kind = delete_kind
        """What a DELETION is recorded as: ``DELETE`` when the stream could not tell
        expirations apart (the consumer did not get the expiry opcode)."""
        self.snapshot: dict[int, tuple[int, int] | None] = {}

    def record(self, event: upr.UprEvent, vb: int, arrival: float) -> Kind | None:
        """Record ``event`` of vbucket ``vb`` (UPR stream messages name it by opaque)."""
        recorder = self.recorder
        if isinstance(event, upr.Mutation | upr.Deletion | upr.Expiration):
            if isinstance(event, upr.Mutation):
                kind, value = Kind.MUTATION, event.value
                flags, expiration = event.flags, event.expiration
            else:
                kind = Kind.EXPIRATION if isinstance(event, upr.Expiration) else self.delete_kind
                value, flags, expiration = None, 0, 0
            recorder.record_item(
                vb,
                event.key,
                kind,
                by_seqno=event.by_seqno,
                rev_seqno=event.rev_seqno,
                cas=event.cas,
                flags=flags,
                expiration=expiration,
                value=value,
                snapshot=self.snapshot.get(vb),
                arrival=arrival,
            )
            return kind
        if isinstance(event, upr.SnapshotMarker):
            snap = (event.start_seqno, event.end_seqno)
            self.snapshot[vb] = snap
            recorder.record_marker(
                vb, Kind.SNAPSHOT, snapshot=snap, flags=int(event.flags), arrival=arrival
            )
            return Kind.SNAPSHOT
        if isinstance(event, upr.SnapshotStart | upr.SnapshotEnd):
            start = isinstance(event, upr.SnapshotStart)
            kind = Kind.SNAPSHOT_START if start else Kind.SNAPSHOT_END
            self.snapshot[vb] = None
            recorder.record_marker(vb, kind, arrival=arrival)
            return kind
        if isinstance(event, upr.StreamEnd):
            recorder.record_marker(vb, Kind.STREAM_END, flags=int(event.reason), arrival=arrival)
            return Kind.STREAM_END
        return None
