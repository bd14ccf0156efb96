"""What every UPR producer stream task here does alike: the node's and the UPR front's.

Theory of operation. A stream's protocol decisions (its state, its end,
acked markers, takeover replies) live in the sans-IO
``adapters.upr.stream_machine.StreamMachine`` (``rules``); ``StreamTask``
only ties it to trio: the cancel scope a close cancels, and one event the
reader task sets whenever the machine says a reply ended a wait, on which
the stream's task waits for the condition it needs (all markers acked, the
SET_VBUCKET_STATE reply) and looks again.
"""

from __future__ import annotations

import trio

from adapters import upr
from adapters.upr.constants import StreamState, VBucketState
from adapters.upr.stream_machine import StreamMachine


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
