"""One UPR producer stream's rules without I/O: its state, its end, acked markers, takeover.

Theory of operation. ``StreamMachine`` holds what one producer stream
decides, for the reference node's stream (from its store) and the UPR
front's (from its log) alike; the I/O side reads the data, sends the
messages the machine returns, in order, and waits where the machine says.
Nothing here waits, reads a clock or touches a socket.

States (``StreamState``, the names 3.0 reports in ``stream_<vb>_state``;
ep-engine v3.0.0 src/upr-stream.cc ``ActiveStream::transitionState``), the
one transition table ``_NEXT``:

=================  ===========================================================
pending            accepted, nothing read yet (the node's first state)
backfilling        sending the catch-up from disk
in-memory          caught up: live items
takeover-wait      SET_VBUCKET_STATE sent (``request_state``), its reply awaited
takeover-send      the reply came (``state_confirmed``): what the vbucket took
                   meanwhile goes under markers with the ACK flag
dead               ended; nothing more is sent (absorbing)
=================  ===========================================================

Inputs and what comes back:

- ``marker(start, end, flags)``: the marker to send (SNAPSHOT_START in the
  draft dialect); one with ACK (``ack_flag``: the takeover-send phase only,
  ``takeoverSendPhase``; the draft has no acks) counts as unacked.
- ``request_state(state)``: the SET_VBUCKET_STATE to send, and whether to
  wait for its reply (never in the draft dialect).
- ``receive(response)``: a consumer's reply for this stream, dispatched by
  command (``_RESPONSES``): ``Wake.STATE_REPLIED`` for the awaited
  SET_VBUCKET_STATE reply, ``Wake.MARKERS_ACKED`` when the last unacked
  marker is acked, else None.
- ``close(reason)``: end early; True when the stream's task must be
  cancelled (the first close wins). ``close_by_consumer()``: CLOSE_STREAM,
  dead at once, and no STREAM_END follows (upr-producer.cc ``closeStream``
  drops the stream before its end message could go).
- ``finish(reason, cancelled)``: the stream's task is done; dead, and the
  STREAM_END to send (None after CLOSE_STREAM). A cancelled task ends with
  the reason its closer gave.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from adapters.upr.constants import (
    Command,
    SnapshotFlags,
    StreamEndReason,
    StreamFlags,
    StreamState,
    VBucketState,
)
from adapters.upr.events import (
    SetVbucketState,
    SnapshotEnd,
    SnapshotMarker,
    SnapshotStart,
    StreamEnd,
    StreamRequest,
)
from adapters.upr.responses import Response

__all__ = ["StreamMachine", "Wake", "stats_rows"]

_S = StreamState
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
_NEXT: dict[StreamState, frozenset[StreamState]] = {
    _S.PENDING: frozenset({_S.BACKFILLING, _S.IN_MEMORY, _S.DEAD}),
    _S.BACKFILLING: frozenset({_S.IN_MEMORY, _S.DEAD}),
    _S.IN_MEMORY: frozenset({_S.IN_MEMORY, _S.TAKEOVER_WAIT, _S.DEAD}),
    _S.TAKEOVER_WAIT: frozenset({_S.TAKEOVER_SEND, _S.DEAD}),
    _S.TAKEOVER_SEND: frozenset({_S.TAKEOVER_WAIT, _S.DEAD}),
    _S.DEAD: frozenset({_S.DEAD}),
}
"""The transition table: the states each state may move to."""


class Wake(enum.Enum):
    """Which wait of the stream's task a reply ends."""

    STATE_REPLIED = "state_replied"
    MARKERS_ACKED = "markers_acked"


class StreamMachine:
    """One producer stream's decisions (see the module docstring)."""

    def __init__(
        self,
        req: StreamRequest,
        high_seqno: int,
        draft: bool,
        state: StreamState = StreamState.PENDING,
    ) -> None:
        self.vbucket = req.vbucket
        self.opaque = req.opaque
        self.end_seqno = req.end_seqno
        if req.flags & (StreamFlags.LATEST | StreamFlags.DISK_ONLY):
            # Both mean "up to what exists now".
            self.end_seqno = min(self.end_seqno, high_seqno)
        self.takeover = bool(req.flags & StreamFlags.TAKEOVER)
        if self.takeover:
            # A takeover runs to the hand-off whatever end it asked for
            # (upr-stream.cc ``ActiveStream::ActiveStream``).
            self.end_seqno = MAX_SEQNO
        self.draft = draft
        self.state = state
        self.end_reason: StreamEndReason | None = None
        self.closed_by_consumer = False
        self.unacked_markers = 0
        self.awaiting: VBucketState | None = None
        """The state whose SET_VBUCKET_STATE reply is awaited."""

    @property
    def live(self) -> bool:
        return self.state is not StreamState.DEAD

    def move(self, state: StreamState) -> None:
        """To ``state`` by the table (a dead stream stays dead); ValueError if not allowed."""
        if self.state is StreamState.DEAD:
            return
        if state not in _NEXT[self.state]:
            raise ValueError(
                f"stream of vbucket {self.vbucket}: {self.state.value} -> {state.value}"
            )
        self.state = state

    # -- messages ----------------------------------------------------------------

    @property
    def ack_flag(self) -> SnapshotFlags:
        """ACK on markers only once the vbucket is being handed over (upr-stream.cc
        ``takeoverSendPhase``), never while catching up, never in the draft."""
        if self.state is StreamState.TAKEOVER_SEND and not self.draft:
            return SnapshotFlags.ACK
        return SnapshotFlags(0)

    def marker(self, start: int, end: int, flags: SnapshotFlags) -> SnapshotMarker | SnapshotStart:
        if self.draft:
            return SnapshotStart(opaque=self.opaque, vbucket=self.vbucket)
        if flags & SnapshotFlags.ACK:
            self.unacked_markers += 1
        return SnapshotMarker(start, end, flags, opaque=self.opaque, vbucket=self.vbucket)

    def snapshot_end(self) -> SnapshotEnd | None:
        """The draft dialect's end of a snapshot (the released one has none)."""
        if self.draft:
            return SnapshotEnd(opaque=self.opaque, vbucket=self.vbucket)
        return None

    def request_state(self, state: VBucketState) -> tuple[SetVbucketState, bool]:
        """SET_VBUCKET_STATE(``state``) to send, and whether to wait for its reply."""
        self.move(StreamState.TAKEOVER_WAIT)
        self.awaiting = None if self.draft else state
        return SetVbucketState(state, opaque=self.opaque, vbucket=self.vbucket), not self.draft

    def state_confirmed(self) -> None:
        """The consumer took the state (or, in the draft, it was sent): takeover-send."""
        self.move(StreamState.TAKEOVER_SEND)

    # -- replies -------------------------------------------------------------------

    def receive(self, response: Response) -> Wake | None:
        handle = _RESPONSES.get(response.command)
        return handle(self) if handle is not None else None

    def _state_reply(self) -> Wake | None:
        if self.awaiting is None:
            return None
        self.awaiting = None
        return Wake.STATE_REPLIED

    def _marker_ack(self) -> Wake | None:
        if not self.unacked_markers:
            return None
        self.unacked_markers -= 1
        return None if self.unacked_markers else Wake.MARKERS_ACKED

    # -- the end ---------------------------------------------------------------------

    def close(self, reason: StreamEndReason) -> bool:
        """End early with ``reason``: True when the task is to be cancelled."""
        if self.end_reason is not None:
            return False
        self.end_reason = reason
        return True

    def close_by_consumer(self) -> bool:
        if not self.close(StreamEndReason.CLOSED):
            return False
        self.closed_by_consumer = True
        self.state = StreamState.DEAD
        return True

    def finish(self, reason: StreamEndReason, cancelled: bool) -> StreamEnd | None:
        """The task ended with ``reason`` (or was cancelled by a close): the STREAM_END."""
        if cancelled and self.end_reason is not None:
            reason = self.end_reason
        self.end_reason = reason
        self.state = StreamState.DEAD
        if self.closed_by_consumer:
            return None  # its CLOSE_STREAM response was the end
        return StreamEnd(reason, opaque=self.opaque, vbucket=self.vbucket)

    # -- statistics ------------------------------------------------------------------

    def takeover_stats(
        self, name: str, remaining: int, backfill: int, vb_items: int
    ) -> dict[str, str]:
        """``STAT dcp-vbtakeover`` (ep-engine v3.0.0 ``UprProducer::addTakeoverStats``)."""
        return {
            "name": name,
            "status": self.state.value,
            "estimate": str(remaining),
            "backfillRemaining": str(backfill),
            "chk_items": str(max(0, remaining - backfill)),
            "vb_items": str(vb_items),
            "on_disk_deletes": "0",
        }


def stats_rows(
    prefix: str, machine: StreamMachine, values: list[tuple[str, object]]
) -> list[tuple[str, str]]:
    """``<prefix>stream_<vb>_<name>`` rows, the end reason last once there is one."""
    if machine.end_reason is not None:
        values = [*values, ("end_reason", machine.end_reason.name.lower())]
    head = f"{prefix}stream_{machine.vbucket}_"
    return [(head + name, str(value)) for name, value in values]


_Handle = Callable[[StreamMachine], "Wake | None"]
_RESPONSES: dict[Any, _Handle] = {
    Command.SET_VBUCKET_STATE: StreamMachine._state_reply,
    Command.SNAPSHOT_MARKER: StreamMachine._marker_ack,
}
"""What each reply a stream waits for does, by command."""
