"""What every UPR producer stream task here does alike: the node's and the UPR front's.

Theory of operation. A stream's protocol decisions (its state, its end,
acked markers, takeover replies) live in the sans-IO
``adapters.upr.stream_machine.StreamMachine`` (``rules``); ``StreamTask``
only ties it to trio: the cancel scope a close cancels, and one event the
reader task sets whenever the machine says a reply ended a wait, on which
the stream's task waits for the condition it needs (all markers acked, the
SET_VBUCKET_STATE reply) and looks again.

``NotifierStream`` is a notifier connection's stream, the same for the node
and the UPR front: it sends no items, only its STREAM_END.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from adapters import upr
from adapters.upr.constants import StreamState, VBucketState
from adapters.upr.stream_machine import StreamMachine, stats_rows


class StreamTask:
    """The trio side of one producer stream (subclasses send and read the data)."""

    def __init__(self, rules: StreamMachine) -> None:
        self.rules = rules
        self.scope = trio.CancelScope()
        self._replied = trio.Event()
        """Set (and replaced) on each reply that ends a wait of the rules."""

    @property
    def state(self) -> StreamState:
        return self.rules.state

    @property
    def end_reason(self) -> upr.StreamEndReason | None:
        return self.rules.end_reason

    @property
    def live(self) -> bool:
        return self.rules.live

    def close(self, reason: upr.StreamEndReason) -> None:
        """End the stream early: it sends STREAM_END(``reason``)."""
        if self.rules.close(reason):
            self.scope.cancel()

    def close_by_consumer(self) -> None:
        """CLOSE_STREAM: dead at once, no STREAM_END (``StreamMachine``)."""
        if self.rules.close_by_consumer():
            self.scope.cancel()

    def on_response(self, event: upr.Response) -> None:
        """A reply of the consumer to this stream's SET_VBUCKET_STATE or marker."""
        if self.rules.receive(event) is not None:
            self._replied.set()
            self._replied = trio.Event()

    async def wait_for_marker_acks(self) -> None:
        while self.rules.unacked_markers:
            await self._replied.wait()

    async def wait_for_state_reply(self) -> None:
        while self.rules.awaiting is not None:
            await self._replied.wait()

    def state_request(self, state: VBucketState) -> upr.SetVbucketState:
        """SET_VBUCKET_STATE(``state``) to send; then ``wait_for_state_reply``."""
        message, _wait = self.rules.request_state(state)
        return message


class NotifierStream(StreamTask):
    """A notifier connection's stream (ep-engine 3.0 src/upr-stream.cc
    ``NotifierStream``): no items, no markers; one STREAM_END(OK) once the
    vbucket's high seqno passes the start seqno asked for, at once when it
    already has. Else it ends as any stream does: STATE_CHANGED when its
    vbucket changes state (``setDead(END_STREAM_STATE)``), and nothing after
    the consumer's CLOSE_STREAM.

    ``beyond(start)`` is the role's wait: it returns OK once the vbucket's
    high seqno exceeds ``start``, or STATE_CHANGED once the vbucket changed
    state; ``send`` sends the STREAM_END (counted in the flow-control window,
    as 3.0's ``BufferLog`` counts every message).
    """

    def __init__(
        self,
        req: upr.StreamRequest,
        *,
        send: Callable[[upr.UprRequest], Awaitable[None]],
        beyond: Callable[[int], Awaitable[upr.StreamEndReason]],
    ) -> None:
        super().__init__(StreamMachine(req, 0, draft=False))
        self.request = req
        self.vbucket = req.vbucket
        self.opaque = req.opaque
        self.items_sent = 0
        self._send = send
        self._beyond = beyond

    async def run(self) -> None:
        reason = upr.StreamEndReason.OK
        with self.scope:
            reason = await self._beyond(self.request.start_seqno)
        end = self.rules.finish(reason, self.scope.cancelled_caught)
        if end is not None:  # else the CLOSE_STREAM response was the end
            await self._send(end)

    def items_remaining(self) -> int:
        return 0

    def stats(self, prefix: str = "") -> list[tuple[str, str]]:
        """``Stream::addStats``'s lines: a notifier stream adds none of its own."""
        req = self.request
        values: list[tuple[str, object]] = [
            ("flags", f"0x{int(req.flags):x}"),
            ("opaque", req.opaque),
            ("start_seqno", req.start_seqno),
            ("end_seqno", req.end_seqno),
            ("vb_uuid", req.vbucket_uuid),
            ("snap_start_seqno", req.snap_start_seqno),
            ("snap_end_seqno", req.snap_end_seqno),
            ("state", self.state.value),
        ]
        return stats_rows(prefix, self.rules, values)
