"""One vbucket of a TAP front session: its UPR stream request, translator and position.

``VbStream`` knows where its vbucket stands in the upstream's terms (uuid,
last seqno sent, the snapshot it is in), so the session can re-request the
stream after an upstream loss, record a registered client's position, and
tell which upstream messages wait for a reply: SET_VBUCKET_STATE (answered
once the TAP peer acked its VBUCKET_SET) and snapshot markers with the ACK
flag (answered once the item that ends them was acked).

The transport draft has no snapshot range: SNAPSHOT_START and SNAPSHOT_END
become an open-ended marker and a close, and STREAM_START is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from adapters import upr
from adapters.fastinit import positional_constructor
from adapters.mcbp import Status
from adapters.tap import TapStreamMessage
from adapters.translate.upr_to_tap import UprToTap
from gateway.fronts.tap.plan import MAX_SEQNO, VbStart
from gateway.fronts.tap.registry import VbResume
from gateway.metrics.figures import VbProgress

_OK = Status.SUCCESS.value
_resume = positional_constructor(VbResume)
"""``VbResume`` (uuid, seqno, snap_start, snap_end, checkpoint_id, backfill_done), made
once per checkpoint a live stream closes and per vbucket a batch touched."""


class VbStream:
    def __init__(
        self,
        start: VbStart,
        checkpoint_ids: Iterator[int],
        *,
        keys_only: bool,
        network_byte_order: bool,
        progress: VbProgress,
        checkpoint_sync: bool = False,
    ) -> None:
        """``checkpoint_sync``: the client set the CHECKPOINT flag, so snapshots
        become CHECKPOINT_START/END (``UprToTap``)."""
        self.vbucket = start.vbucket
        self.start = start
        self._ids = checkpoint_ids
        self._keys_only = keys_only
        self._network_order = network_byte_order
        self._checkpoint_sync = checkpoint_sync
        self.translator = self._translator(start)
        self.uuid = start.uuid
        self._marker_ack: tuple[int, int] | None = None
        """(end seqno, opaque) of an ACK-flagged marker not yet answered."""
        self.progress = progress
        progress.sent_seqno = progress.acked_seqno = start.start_seqno
        progress.upstream_high_seqno = max(progress.upstream_high_seqno, start.start_seqno)
        self.ended = start.end_seqno <= start.start_seqno

    def _translator(self, start: VbStart) -> UprToTap:
        translator = UprToTap(
            self.vbucket,
            backfill=start.backfill and not start.resumed,
            continue_backfill=start.backfill and start.resumed,
            keys_only=self._keys_only,
            network_byte_order=self._network_order,
            checkpoint_ids=self._ids,
            checkpoint_sync=self._checkpoint_sync,
        )
        translator.last_seqno = start.start_seqno
        translator.snap_start, translator.snap_end = start.snap_start, start.snap_end
        return translator

    @property
    def snap(self) -> tuple[int, int]:
        """The range of the latest snapshot marker (the translator keeps it)."""
        return self.translator.snap_start, self.translator.snap_end

    @property
    def items_in_snap(self) -> int:
        return self.translator.items_in_snap

    # -- requests --------------------------------------------------------------

    def stream_request(self, opaque: int, takeover: bool) -> upr.StreamRequest:
        start = self.start
        flags = upr.StreamFlags.TAKEOVER if takeover else upr.StreamFlags(0)
        return upr.StreamRequest(
            flags=flags,
            start_seqno=start.start_seqno,
            end_seqno=start.end_seqno,
            vbucket_uuid=start.uuid,
            snap_start_seqno=start.snap_start,
            snap_end_seqno=start.snap_end,
            opaque=opaque,
            vbucket=self.vbucket,
        )

    def accepted(self, failover_log: upr.FailoverEntries) -> None:
        if failover_log:
            self.uuid = failover_log[0][0]

    def prepare_resume(self) -> None:
        """The upstream is gone: next time, request from the last seqno sent."""
        position = self.position()
        self.start = VbStart(
            self.vbucket,
            start_seqno=position.seqno,
            end_seqno=self.start.end_seqno,
            uuid=position.uuid,
            snap_start=position.snap_start,
            snap_end=position.snap_end,
        )
        self._marker_ack = None
        self.translator.resume()

    def restart_from_zero(self) -> list[TapStreamMessage]:
        """After a rollback: close what is open, then a full backfill from seqno 0."""
        closing = self.translator.finish()
        self.start = VbStart.full(self.vbucket, end=self.start.end_seqno)
        self.translator = self._translator(self.start)
        self.uuid = 0
        self._marker_ack = None
        self.progress.sent_seqno = self.progress.acked_seqno = 0
        return closing

    # -- stream messages -------------------------------------------------------

    def translate(self, event: upr.UprEvent) -> list[TapStreamMessage]:
        return _TRANSLATE.get(type(event), VbStream._feed)(self, event)

    def _stream_start(self, event: upr.StreamStart) -> list[TapStreamMessage]:
        return []

    def _snapshot_start(self, event: upr.SnapshotStart) -> list[TapStreamMessage]:
        first = self.translator.last_seqno + 1
        flags = (
            upr.SnapshotFlags.DISK if self.translator.backfill_pending else upr.SnapshotFlags.MEMORY
        )
        return self._marker(
            upr.SnapshotMarker(first, MAX_SEQNO, flags, event.opaque, event.vbucket)
        )

    def _snapshot_end(self, event: upr.SnapshotEnd) -> list[TapStreamMessage]:
        return self.translator.finish()

    def _marker(self, event: upr.SnapshotMarker) -> list[TapStreamMessage]:
        progress = self.progress
        if event.end_seqno != MAX_SEQNO:
            progress.upstream_high_seqno = max(progress.upstream_high_seqno, event.end_seqno)
        if event.flags & upr.SnapshotFlags.DISK:
            progress.backfilling = True
            progress.backfill_end_seqno = event.end_seqno
        out = self._feed(event)
        if self.translator.in_backfill and not progress.backfilling:
            # a backfill served from memory (no DISK flag)
            progress.backfilling = True
            progress.backfill_end_seqno = event.end_seqno
        return out

    def _item(self, event: upr.Mutation | upr.Deletion | upr.Expiration) -> list[TapStreamMessage]:
        progress = self.progress
        progress.sent_seqno = event.by_seqno
        progress.upstream_high_seqno = max(progress.upstream_high_seqno, event.by_seqno)
        return self._feed(event)

    def _feed(self, event: upr.UprEvent) -> list[TapStreamMessage]:
        out = self.translator.feed(event)
        if self.progress.backfilling and not self.translator.in_backfill:
            self.progress.backfilling = False
        return out

    def advance_item(self, item: upr.Mutation | upr.Deletion | upr.Expiration) -> bool:
        """The fast path's ``translate`` of an item: true when it ends the open snapshot."""
        self.took_item(item.by_seqno)
        return self.translator.advance(item.by_seqno)

    def took_item(self, by_seqno: int) -> None:
        """Progress after an item (the translator has taken its seqno or is about to)."""
        progress = self.progress
        progress.sent_seqno = by_seqno
        if by_seqno > progress.upstream_high_seqno:
            progress.upstream_high_seqno = by_seqno

    def took_marker(self, start: int, end: int, flags: int) -> None:
        """Progress after a snapshot marker of the fast path (as ``translate`` keeps it)."""
        progress = self.progress
        if end != MAX_SEQNO and end > progress.upstream_high_seqno:
            progress.upstream_high_seqno = end
        if flags & upr.SnapshotFlags.DISK:
            progress.backfilling = True
            progress.backfill_end_seqno = end

    @property
    def awaits_marker_reply(self) -> bool:
        """An ACK-flagged snapshot marker is not answered yet (see ``reply_due``)."""
        return self._marker_ack is not None

    def item_done(self) -> None:
        """After an item of the fast path (and the close it caused)."""
        if self.progress.backfilling and not self.translator.in_backfill:
            self.progress.backfilling = False

    def reply_due(self, event: upr.UprEvent) -> upr.Response | None:
        """The reply ``event`` makes due, once what was sent so far is acked."""
        return _REPLY_DUE.get(type(event), VbStream._settle_marker)(self, event)

    def _state_reply(self, event: upr.SetVbucketState) -> upr.Response:
        return upr.Response(upr.Command.SET_VBUCKET_STATE, event.opaque, _OK)

    def _settle_marker(self, event: upr.UprEvent) -> upr.Response | None:
        """An ACK-flagged marker is answered once its snapshot ended: by any
        message that is not an item of it."""
        pending = self._marker_ack
        if pending is None:
            return None
        self._marker_ack = None
        return upr.Response(upr.Command.SNAPSHOT_MARKER, pending[1], _OK)

    def _item_reply(
        self, event: upr.Mutation | upr.Deletion | upr.Expiration
    ) -> upr.Response | None:
        pending = self._marker_ack
        if pending is None or event.by_seqno < pending[0]:
            return None
        return self._settle_marker(event)

    def _marker_reply(self, event: upr.SnapshotMarker) -> upr.Response | None:
        reply = self._settle_marker(event)
        if event.flags & upr.SnapshotFlags.ACK:
            self._marker_ack = (event.end_seqno, event.opaque)
        return reply

    def took_run(self) -> None:
        """Progress after a run of the fast path's frames (``translate_items``): as
        ``took_marker``, ``took_item`` and ``item_done`` after each would leave it
        (its markers are neither disk snapshots nor open-ended)."""
        translator = self.translator
        progress = self.progress
        last = translator.last_seqno
        progress.sent_seqno = last
        high = translator.snap_end if translator.snap_end != MAX_SEQNO else 0
        if last > high:
            high = last
        if high > progress.upstream_high_seqno:
            progress.upstream_high_seqno = high
        if progress.backfilling and not translator.in_backfill:
            progress.backfilling = False

    def closed_position(self, seqno: int, checkpoint_id: int) -> VbResume:
        """``position`` just after the item at ``seqno`` closed checkpoint ``checkpoint_id``
        (the item ends its snapshot, so no snapshot is open at it)."""
        return _resume(
            self.uuid, seqno, seqno, seqno, checkpoint_id, not self.translator.backfill_pending
        )

    def position(self) -> VbResume:
        """Where the TAP peer stands once it has everything sent so far."""
        translator = self.translator
        last = translator.last_seqno
        snap_start, snap_end = translator.snap_start, translator.snap_end
        if not (translator.items_in_snap and snap_start <= last < snap_end):
            snap_start = snap_end = last
        return _resume(
            self.uuid,
            last,
            snap_start,
            snap_end,
            translator.last_closed_checkpoint,
            not translator.backfill_pending,
        )


_TRANSLATE: dict[type, Callable[[VbStream, Any], list[TapStreamMessage]]] = {
    upr.Mutation: VbStream._item,
    upr.Deletion: VbStream._item,
    upr.Expiration: VbStream._item,
    upr.SnapshotMarker: VbStream._marker,
    upr.SnapshotStart: VbStream._snapshot_start,
    upr.SnapshotEnd: VbStream._snapshot_end,
    upr.StreamStart: VbStream._stream_start,
}
"""What ``translate`` does with each event (any other goes to the translator as is)."""

_REPLY_DUE: dict[type, Callable[[VbStream, Any], upr.Response | None]] = {
    upr.SetVbucketState: VbStream._state_reply,
    upr.Mutation: VbStream._item_reply,
    upr.Deletion: VbStream._item_reply,
    upr.Expiration: VbStream._item_reply,
    upr.SnapshotMarker: VbStream._marker_reply,
}
"""What reply each event makes due (any other only settles a pending marker)."""
