"""A TAP session's vbucket streams: UPR stream requests in, TAP messages out.

Theory of operation. ``UpstreamStreams`` holds one ``VbStream`` per vbucket
of the plan and routes what the upstream sends by stream opaque. ``on_data``
takes what one socket read brought: runs of items and plain snapshot markers
take the fast path (``adapters.translate.upr_to_tap_fast``, frame bytes to
frame bytes, the bookkeeping done once per run), anything else is decoded
and goes through the vbucket's ``UprToTap`` (the event path). A stream's
items leave the fast path while a marker waits for its reply, once the
stream ended, and whenever messages are captured. What reaches the TAP peer
goes through the session's ``TapPeer``: messages into its batch, flow-control
credit and owed replies into its settlement. A rollback answer restarts that
vbucket from 0 behind OPAQUE(INITIAL_VBUCKET_STREAM), since a TAP client
cannot roll back partially; a refused stream ends its vbucket.

What a 3.0 producer does not send is taken as its consumer takes it
(ep-engine 3.0 upr-consumer.cc, PassiveStream): an item whose seqno does not
grow is dropped, a message for no live stream (a stray opaque, anything after
STREAM_END) is answered KEY_ENOENT and dropped, the stream goes on. What
cannot be read at all (an unknown opcode, a wrong extras length, a bad magic)
or has no place in a stream (FLUSH) raises ``UprUpstreamMalformed``: one line,
and the session closes the upstream and the TAP connection rather than
reconnect to be sent the same bytes again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import HEADER_SIZE, Frame, Status
from adapters.tap import ConnectFlags
from adapters.translate.upr_to_tap import UprToTap
from adapters.translate.upr_to_tap_fast import (
    close_frame,
    marker_frame,
    snapshot_marker,
    stamped_item,
    translate_items,
)
from adapters.upr.flow_control import counts
from gateway.fronts.tap.peer import TapPeer
from gateway.fronts.tap.plan import ConnectionPlan
from gateway.fronts.tap.registry import Registry
from gateway.fronts.tap.upstream import UprUpstream, UprUpstreamError, UprUpstreamMalformed
from gateway.fronts.tap.vbstream import VbStream
from gateway.metrics.figures import GatewayStats, StreamStats
from gateway.tools.capture.mapping import UprRecording

__all__ = ["UpstreamStreams"]

log = logging.getLogger(__name__)

_OK = Status.SUCCESS.value
_ENOENT = Status.KEY_NOT_FOUND.value
_TMPFAIL = Status.TEMPORARY_FAILURE.value
_ITEM_TYPES = frozenset((upr.Mutation, upr.Deletion, upr.Expiration))
_MARKER_ACK = upr.SnapshotFlags.ACK.value
_MARKER_SIZE = HEADER_SIZE + 20


class UpstreamStreams:
    def __init__(
        self,
        plan: ConnectionPlan,
        peer: TapPeer,
        registry: Registry,
        stats: StreamStats,
        gateway_stats: GatewayStats,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self.peer = peer
        self.registry = registry
        self.stats = stats
        self.gateway_stats = gateway_stats
        keys_only = plan.has(ConnectFlags.KEYS_ONLY)
        network_order = plan.has(ConnectFlags.FIX_FLAG_BYTEORDER)
        # Checkpoint messages only for a client that asked (2.5.1 tapconnection.cc
        # ``supportCheckpointSync_``, set by the CHECKPOINT flag alone).
        checkpoint_sync = plan.has(ConnectFlags.CHECKPOINT)
        self.vbuckets = {
            start.vbucket: VbStream(
                start,
                registry.checkpoint_ids(start.vbucket),
                keys_only=keys_only,
                network_byte_order=network_order,
                progress=stats.vbucket(start.vbucket),
                checkpoint_sync=checkpoint_sync,
            )
            for start in plan.starts
        }
        self.by_opaque: dict[int, VbStream] = {}
        self._fast_streams: dict[int, UprToTap] = {}
        """By stream opaque, the translators whose items may take the fast path."""
        self._opaque_of: dict[int, int] = {}
        """The stream opaque of each vbucket's current upstream stream."""
        self.upstream: UprUpstream | None = None
        """The connection the streams are requested on (set by the session)."""
        self.captured_in: UprRecording | None = None
        self._stale_said: set[int] = set()
        """Vbuckets whose dropped stale item was logged."""
        self._stray_said = False
        self.spawn: Callable[..., object] | None = None
        """Starts a task in the session's nursery (set by the session)."""
        self.retry_delays = (0.1, 5.0)
        """First and longest wait before a stream refused TMPFAIL is asked again."""
        self._tmpfails: dict[int, int] = {}
        """Per vbucket, the TMPFAIL answers in a row."""
        self.lost_vbuckets: list[int] = list(plan.skipped)
        """Vbuckets whose stream ended other than OK, in the order they ended; a
        listed vbucket the upstream lacks was never streamed and counts first."""
        for vb in plan.skipped:
            # As 2.x registerCursor: "VBucket %d not found for TAP cursor. Skip it..."
            log.warning("%s: vbucket %d: not on the upstream, skipped", self.name, vb)
            gateway_stats.stream_ends_total["tap_front", "skipped"] += 1

    @property
    def all_ended(self) -> bool:
        return all(vb.ended for vb in self.vbuckets.values())

    @property
    def any_lost(self) -> bool:
        """Some vbucket ended other than by being served to its end (refused, or a
        STREAM_END whose reason is not OK)."""
        return bool(self.lost_vbuckets)

    async def request(self) -> None:
        """Request every stream that has not ended, on the current upstream."""
        upstream = self.upstream
        assert upstream is not None
        requests = []
        for vb in self.vbuckets.values():
            if vb.ended:
                continue
            requests.append(upr.encode(self._new_request(vb, upstream), upstream.dialect))
        await upstream.send(b"".join(requests))

    def lost(self) -> None:
        """The upstream is gone: forget its opaques, each stream resumes where it was."""
        self.by_opaque.clear()
        self._fast_streams.clear()
        for vb in self.vbuckets.values():
            vb.prepare_resume()

    async def finish(self) -> None:
        """Close what every translator left open."""
        for vb in self.vbuckets.values():
            for message in vb.translator.finish():
                await self.peer.emit(message, vb)

    # -- routing -------------------------------------------------------------

    def _new_request(self, vb: VbStream, upstream: UprUpstream) -> upr.StreamRequest:
        """``vb``'s stream request under a new opaque, routed to it."""
        opaque = upstream.next_opaque()
        self._route(opaque, vb)
        return vb.stream_request(opaque, self.plan.takeover)

    def _route(self, opaque: int, vb: VbStream) -> None:
        """``vb``'s stream now answers to ``opaque``."""
        self.by_opaque[opaque] = vb
        self._opaque_of[vb.vbucket] = opaque
        self._refresh_fast(vb)

    def _refresh_fast(self, vb: VbStream) -> None:
        """Let ``vb``'s items take the fast path unless a marker waits for its reply."""
        opaque = self._opaque_of.get(vb.vbucket)
        if opaque is None or self.by_opaque.get(opaque) is not vb:
            return
        if vb.awaits_marker_reply or vb.ended:
            self._fast_streams.pop(opaque, None)
        else:
            self._fast_streams[opaque] = vb.translator

    # -- the fast path -------------------------------------------------------

    async def on_data(self) -> None:
        """What one socket read brought: runs of items and plain markers take the fast
        path (frame bytes to frame bytes), anything else the events'."""
        upstream = self.upstream
        assert upstream is not None
        peer = self.peer
        fast = peer.captured_out is None and upstream.dialect is upr.DCP
        producer = peer.producer
        while True:
            if fast:
                closing = self._fast_items(upstream)
                if closing is not None:
                    await self._close_fast(closing)
                    continue
                if not producer.can_send:
                    await peer.wait_for_room()
                    continue
                reader = upstream.reader
                marker = snapshot_marker(reader.buffer, reader.offset)
                if marker is not None and await self._marker_fast(upstream, *marker):
                    continue
            try:
                frame = upstream.next_frame()
            except ProtocolError as exc:  # no frame at all (a bad magic, a huge length)
                raise self._malformed(str(exc)) from None
            if frame is None:
                return
            await self._on_frame(frame)

    def _fast_items(self, upstream: UprUpstream) -> VbStream | None:
        """``translate_items`` from where the upstream's buffer stands (items, plain
        markers and the closes items make), with the bookkeeping of ``_on_frame``
        and ``TapPeer.emit`` done once per run: returns the stream whose snapshot
        the run's last item ended when no room was left to close it (or None)."""
        touched: dict[int, UprToTap] = {}
        closed: list[int] = []
        peer = self.peer
        reader = upstream.reader
        offset, credit, mutations, deletions, markers, closing = translate_items(
            reader.buffer,
            reader.offset,
            self._fast_streams,
            peer.producer,
            peer.batch,
            touched,
            closed,
        )
        reader.advance(offset)
        if not credit:
            return None
        upstream.window.unacked_bytes += credit
        settling = peer.settlements.settling
        settling.credit += credit
        if not settling.arrival and (mutations or deletions):
            settling.arrival = time.time()
        items_sent = self.stats.items_sent
        if mutations:
            items_sent["mutation"] += mutations
        if deletions:
            items_sent["deletion"] += deletions
        if markers:
            items_sent["marker"] += markers
        vbuckets = self.vbuckets
        settled = settling.touched
        for vbucket in touched:
            vb = vbuckets[vbucket]
            vb.took_run()
            settled[vbucket] = vb
        if closed:
            checkpoint_closed = self.registry.checkpoint_closed
            for at in range(0, len(closed), 3):
                vbucket, checkpoint_id, seqno = closed[at : at + 3]
                position = vbuckets[vbucket].closed_position(seqno, checkpoint_id)
                checkpoint_closed(vbucket, checkpoint_id, position)
        return None if closing is None else vbuckets[closing.vbucket]

    async def _close_fast(self, vb: VbStream) -> None:
        """Close the snapshot ``vb``'s last item ended, as ``emit`` of ``close()`` would."""
        peer = self.peer
        if not peer.producer.can_send:
            await peer.wait_for_room()
        closed = close_frame(vb.translator, peer.producer)
        if closed is not None:
            data, checkpoint_id = closed
            if checkpoint_id is not None:
                self.registry.checkpoint_closed(vb.vbucket, checkpoint_id, vb.position())
                self.stats.items_sent["marker"] += 1
            peer.batch.append(data)
        peer.settlements.settling.touched[vb.vbucket] = vb
        vb.item_done()

    async def _marker_fast(
        self, upstream: UprUpstream, opaque: int, start: int, end: int, flags: int
    ) -> bool:
        """A snapshot marker that only opens a checkpoint, as ``_on_frame`` would
        take it; false (nothing done) for one the event path must take."""
        vb = self.by_opaque.get(opaque)
        if vb is None or opaque not in self._fast_streams or flags & _MARKER_ACK:
            return False
        peer = self.peer
        if not peer.producer.can_send:
            await peer.wait_for_room()
        data = marker_frame(vb.translator, peer.producer, start, end, flags)
        if data is None:
            return False
        reader = upstream.reader
        reader.advance(reader.offset + _MARKER_SIZE)
        upstream.window.unacked_bytes += _MARKER_SIZE
        peer.settlements.settling.credit += _MARKER_SIZE
        vb.took_marker(start, end, flags)
        if data:  # (empty: no CHECKPOINT_START without checkpoint sync)
            peer.batch.append(data)
            self.stats.items_sent["marker"] += 1
        peer.settlements.settling.touched[vb.vbucket] = vb
        vb.item_done()
        return True

    # -- the event path ------------------------------------------------------

    async def _on_frame(self, frame: Frame) -> None:
        upstream = self.upstream
        assert upstream is not None
        try:
            event = upr.decode_frame(frame, upstream.dialect)
        except ProtocolError as exc:
            raise self._malformed(str(exc)) from None
        await _ON_EVENT.get(type(event), UpstreamStreams._on_stream_message)(self, event, frame)

    async def _on_noop(self, event: upr.Noop, frame: Frame) -> None:
        upstream = self.upstream
        assert upstream is not None
        if not upstream.answered(frame):  # (the keeper answers those it finds first)
            await upstream.send_event(upr.Response(upr.Command.NOOP, event.opaque, _OK))

    async def _on_stream_message(self, event: upr.UprEvent, frame: Frame) -> None:
        """A message of a stream (an item, a marker, SET_VBUCKET_STATE, STREAM_END...)."""
        upstream = self.upstream
        assert upstream is not None
        vb = self.by_opaque.get(event.opaque)
        if vb is None or vb.ended:
            await self._stray(event, frame, vb)
            return
        peer = self.peer
        settling = peer.settlements.settling
        counted = counts(event)
        if counted:
            upstream.window.unacked_bytes += frame.size
        item = type(event) in _ITEM_TYPES
        if item and event.by_seqno <= vb.translator.last_seqno:  # type: ignore[union-attr]
            self._drop_stale(vb, event)  # type: ignore[arg-type]
            await upstream.acknowledge(frame.size)  # freed now: no TAP ack will cover it
            return
        if counted:
            settling.credit += frame.size
        if item and not settling.arrival:
            settling.arrival = time.time()
        if self.captured_in is not None:
            self.captured_in.record(event, vb.vbucket, time.time())
        try:
            if item and peer.captured_out is None:
                await self._emit_item(event, vb)  # type: ignore[arg-type]
            else:
                for message in vb.translate(event):
                    await peer.emit(message, vb)
        except ProtocolError as exc:  # what has no place in a stream (FLUSH)
            raise self._malformed(f"{exc} opcode=0x{frame.opcode:02x}") from None
        reply = vb.reply_due(event)
        if reply is not None:
            # Looked up again: a flush while emitting may have ended the settlement.
            peer.settlements.settling.replies.append(upr.encode(reply, upstream.dialect))
            peer.settlements.end()
        self._refresh_fast(vb)
        if type(event) is upr.StreamEnd:
            if event.reason == upr.StreamEndReason.STATE_CHANGED and not self.plan.takeover:
                await self._request_again(vb, event.opaque)
            else:
                await self._end_stream(vb, _reason_name(event.reason))

    async def _stray(self, event: upr.UprEvent, frame: Frame, vb: VbStream | None) -> None:
        """A stream message for no stream of this connection, or for one that ended
        (a 3.0 stream sends nothing after STREAM_END): dropped with KEY_ENOENT, and
        the connection goes on, as a 3.0 consumer does (ep-engine 3.0 upr-consumer.cc
        ``mutation`` and the others: no such active stream, ENOENT; memcached
        answers it and the producer ignores the answer). Said once per connection."""
        upstream = self.upstream
        assert upstream is not None
        self.gateway_stats.protocol_errors_total["tap_front", "upstream_stray"] += 1
        if not self._stray_said:
            self._stray_said = True
            which = "no stream of this connection" if vb is None else "a stream that ended"
            log.warning(
                "%s: dropping %s from upstream for %s (opcode=0x%02x field=opaque value=%d)",
                self.name,
                event.NAME,
                which,
                frame.opcode,
                event.opaque,
            )
        command = getattr(event, "COMMAND", None)
        if command is not None:
            await upstream.send_event(upr.Response(command, event.opaque, _ENOENT))
        if counts(event):
            upstream.window.unacked_bytes += frame.size
            await upstream.acknowledge(frame.size)

    def _drop_stale(self, vb: VbStream, item: upr.Mutation | upr.Deletion | upr.Expiration) -> None:
        """An item whose seqno does not grow: dropped, the stream goes on, as a 3.0
        consumer does (ep-engine 3.0 upr-stream.cc ``PassiveStream::messageReceived``
        answers ERANGE for that item only). Said once per vbucket and connection."""
        self.gateway_stats.protocol_errors_total["tap_front", "upstream_seqno_not_growing"] += 1
        if vb.vbucket not in self._stale_said:
            self._stale_said.add(vb.vbucket)
            log.warning(
                "%s: vbucket %d: dropping %s by_seqno %d from upstream: not above %d",
                self.name,
                vb.vbucket,
                item.NAME,
                item.by_seqno,
                vb.translator.last_seqno,
            )

    def _malformed(self, what: str) -> UprUpstreamMalformed:
        self.gateway_stats.protocol_errors_total["tap_front", "upstream_malformed"] += 1
        upstream = self.upstream
        address = upstream.address if upstream is not None else "?"
        return UprUpstreamMalformed(
            f"UPR upstream {address} sent what no 3.0 producer sends: {what}; "
            "closing it and this TAP connection"
        )

    async def _emit_item(
        self, item: upr.Mutation | upr.Deletion | upr.Expiration, vb: VbStream
    ) -> None:
        """An item frame to frame: what ``translate`` and ``TapPeer.emit`` do."""
        peer = self.peer
        closes = vb.advance_item(item)
        if not peer.producer.can_send:
            await peer.wait_for_room()
        peer.batch.append(stamped_item(item, vb.translator, peer.producer))
        self.stats.items_sent["mutation" if type(item) is upr.Mutation else "deletion"] += 1
        peer.settlements.settling.touched[vb.vbucket] = vb
        if closes:
            for message in vb.translator.close():
                await peer.emit(message, vb)
        vb.item_done()

    async def _on_response(self, response: upr.UprResponse, _frame: Frame) -> None:
        vb = self.by_opaque.get(response.opaque)
        answer = _STREAM_REQUEST_ANSWERS.get(type(response))
        if vb is None or answer is None:
            return  # NOOP and buffer-ack answers need nothing
        if isinstance(response, upr.Response) and response.command is not upr.Command.STREAM_REQ:
            return
        await answer(self, vb, response)

    async def _accepted(self, vb: VbStream, response: upr.StreamRequestOk) -> None:
        self._tmpfails.pop(vb.vbucket, None)
        vb.accepted(response.failover_log)

    async def _rolled_back(self, vb: VbStream, response: upr.StreamRequestRollback) -> None:
        log.warning(
            "%s: vbucket %d: upstream asks to roll back to %d; the client cannot roll "
            "back partially, so the vbucket is streamed again from 0",
            self.name,
            vb.vbucket,
            response.rollback_seqno,
        )
        self.gateway_stats.rollbacks_total["tap_front"] += 1
        self.gateway_stats.last_rollback_seqno["tap_front"] = response.rollback_seqno
        for message in vb.restart_from_zero():
            await self.peer.emit(message, vb)
        self._fast_streams.pop(response.opaque, None)
        upstream = self.upstream
        assert upstream is not None
        await upstream.send_event(self._new_request(vb, upstream))

    async def _refused(self, vb: VbStream, response: upr.Response) -> None:
        if response.status == _TMPFAIL and self.spawn is not None:
            self._ask_again(vb, response.opaque)
            return
        text = response.value.decode("utf-8", "replace")
        log.error(
            "%s: vbucket %d: upstream refused the stream (status 0x%02x%s)",
            self.name,
            vb.vbucket,
            response.status,
            f": {text}" if text else "",
        )
        await self._end_stream(vb, f"refused_0x{response.status:02x}")

    async def _request_again(self, vb: VbStream, opaque: int) -> None:
        """The upstream vbucket changed state: request its stream again from where it
        stands. A 2.x producer's cursor outlived a state change of its vbucket
        (ep-engine 2.x vbucket.cc ``VBucket::setState`` leaves the checkpoint
        cursors alone; tapconnection.cc ``TapProducer::nextFgFetched_UNLOCKED``
        skips a dead vbucket only while it is dead), so the TAP client got what
        was written once it lived again, on the same connection. A 3.0 upstream
        streams a vbucket in any state (``UprProducer::streamRequest``), so the
        new stream waits while it is dead; one that was deleted answers
        NOT_MY_VBUCKET and is lost for good, as 2.x's cursor went with the
        deleted vbucket (checkpoint.cc ``CheckpointManager::nextItem``: "cursor
        ... is not found", nothing ever again)."""
        self.gateway_stats.stream_ends_total["tap_front", "state_changed"] += 1
        log.info(
            "%s: vbucket %d: upstream vbucket changed state; requesting it again",
            self.name,
            vb.vbucket,
        )
        self.by_opaque.pop(opaque, None)  # what the old stream still sends is stray
        self._fast_streams.pop(opaque, None)
        vb.prepare_resume()
        upstream = self.upstream
        assert upstream is not None
        await upstream.send_event(self._new_request(vb, upstream))

    def _ask_again(self, vb: VbStream, opaque: int) -> None:
        """TMPFAIL: a 3.0 upstream's vbucket is being filled by a backfill (open
        checkpoint id 0, src/upr-producer.cc ``UprProducer::streamRequest``). A 2.x
        cursor waited there (src/checkpoint.cc ``CheckpointManager::nextItem``:
        "still in backfill phase", nothing yet), so the stream is asked again
        with backoff, not lost."""
        attempts = self._tmpfails.get(vb.vbucket, 0) + 1
        self._tmpfails[vb.vbucket] = attempts
        first, longest = self.retry_delays
        delay = min(longest, first * 2 ** min(attempts - 1, 16))
        if attempts == 1:
            log.warning(
                "%s: vbucket %d: upstream is filling it (TMPFAIL); asking again with backoff",
                self.name,
                vb.vbucket,
            )
        self.by_opaque.pop(opaque, None)
        assert self.spawn is not None
        self.spawn(self._request_later, vb, self.upstream, delay)

    async def _request_later(self, vb: VbStream, upstream: UprUpstream, delay: float) -> None:
        await trio.sleep(delay)
        if self.upstream is not upstream or vb.ended:
            return  # a new upstream requested every stream again
        # A failed send: the pump sees the loss too, and asks again on the next upstream.
        with contextlib.suppress(UprUpstreamError):
            await upstream.send_event(self._new_request(vb, upstream))

    async def _end_stream(self, vb: VbStream, reason: str) -> None:
        vb.ended = True
        if reason != "ok":
            self.lost_vbuckets.append(vb.vbucket)
        self._refresh_fast(vb)
        self.gateway_stats.stream_ends_total["tap_front", reason] += 1
        for message in vb.translator.finish():
            await self.peer.emit(message, vb)
        if reason == "ok" and self.plan.takeover:
            self.gateway_stats.takeovers_completed_total["tap_front"] += 1


_ON_EVENT: dict[type, Callable[[UpstreamStreams, Any, Frame], Awaitable[None]]] = {
    upr.StreamRequestOk: UpstreamStreams._on_response,
    upr.StreamRequestRollback: UpstreamStreams._on_response,
    upr.FailoverLogResponse: UpstreamStreams._on_response,
    upr.AddStreamResponse: UpstreamStreams._on_response,
    upr.Response: UpstreamStreams._on_response,
    upr.Noop: UpstreamStreams._on_noop,
}
"""What the event path does with each upstream event; any other is a stream's message
(``_on_stream_message``)."""

_STREAM_REQUEST_ANSWERS: dict[type, Callable[[UpstreamStreams, VbStream, Any], Awaitable[None]]] = {
    upr.StreamRequestOk: UpstreamStreams._accepted,
    upr.StreamRequestRollback: UpstreamStreams._rolled_back,
    upr.Response: UpstreamStreams._refused,  # a STREAM_REQ refused with another status
}
"""What each answer to a stream request does (by its type; the codec gives a failed
STREAM_REQ the generic ``Response``)."""


def _reason_name(reason: int) -> str:
    try:
        return upr.StreamEndReason(reason).name.lower()
    except ValueError:
        return f"reason_{reason}"
