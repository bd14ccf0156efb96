"""One TAP peer served from the UPR streams of an upstream node.

Theory of operation. A ``TapSession`` owns one TAP connection (a client that
sent CONNECT, or a TAP receiver the gateway pushes to) and one upstream UPR
connection of its own, and runs three tasks:

- the pump, the only task that writes stream messages: it requests one UPR
  stream per vbucket of the plan, then reads the upstream a socket read at a
  time, translates every frame with that vbucket's ``UprToTap``, stamps the
  TAP messages with the sans-IO ``TapProducer`` (sequence numbers, ack
  requests, the unacked window) and writes the whole batch with one send;
- the reader: acks and nacks from the TAP peer go to the ``TapProducer``
  (framed by body length alone, as memcached 2.x read them, since the
  classic 2.x client's acks claim a key and extras over an empty body);
  what an ack releases is then settled upstream (see below); a request that
  is not TAP's (STAT, VERSION, an unknown opcode) goes to the front's
  command door (``answer``), as 2.x memcached ran every packet of a TAP
  connection through its command dispatcher (daemon/memcached.c
  ``conn_ship_log``): answered between stream messages, the stream going on;
- the timers: a NOOP on an idle TAP connection, the resend after a busy nack.

Backpressure runs end to end. The upstream stops at the flow-control buffer
the gateway announced, and the gateway returns buffer bytes only for what
the TAP peer acknowledged (with support-ack) or what was handed to its
socket (without). Each batch's upstream bytes, the replies the upstream
waits for (SET_VBUCKET_STATE, acknowledged snapshot markers) and the
positions reached travel as a ``Settlement`` attached to the last TAP
message of the batch, and are settled when that message is acked. The last
message of every batch asks for an ack, so a peer that acks only when asked
can never leave the upstream stalled on a full buffer. Memory per session is
bounded by the upstream buffer plus the socket outbox.

Upstream loss: the pump reconnects with backoff and re-requests every open
stream from the last seqno sent, within the snapshot it was in; the
translators continue the checkpoint or backfill that was open, so the TAP
peer sees neither a gap nor a duplicate. Acks keep arriving meanwhile and
never cost the TAP peer its connection: what they release is settled on
the TAP side (positions, counters) at once, while the upstream credit and
replies they carry lapse with the connection they were owed to. A rollback answer restarts that
vbucket with a full backfill behind OPAQUE(INITIAL_VBUCKET_STREAM).
"""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import HEADER_SIZE, Frame, Magic, Status
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapOpcode,
    TapStreamMessage,
    TapVbucketSet,
    decode_frame,
    encode,
)
from adapters.tap.codec import is_tap_opcode
from adapters.tap.producer import SEQNO_MODULUS, ProducerState, TapProducer
from adapters.translate.upr_to_tap import UprToTap
from adapters.translate.upr_to_tap_fast import (
    close_frame,
    marker_frame,
    snapshot_marker,
    stamped_item,
    translate_items,
)
from adapters.upr.flow_control import counts
from gateway.capture.mapping import TapRecording, UprRecording
from gateway.capture.recorder import open_recorder
from gateway.capture.records import Kind
from gateway.io.door import Answer, refuse_command
from gateway.stats import GatewayStats, StreamStats
from gateway.tapfront.plan import ConnectionPlan
from gateway.tapfront.registry import Registry
from gateway.tapfront.settlement import SessionConfig, Settlement
from gateway.tapfront.upstream import UprUpstream, UpstreamError
from gateway.tapfront.vbstream import VbStream
from gateway.wire import PacketConnection

__all__ = ["SessionConfig", "SessionFailed", "TapSession"]

log = logging.getLogger(__name__)

_OK = Status.SUCCESS.value
_KINDS: dict[type, str] = {
    TapMutation: "mutation",
    TapDelete: "deletion",
    TapCheckpointStart: "marker",
    TapCheckpointEnd: "marker",
    TapVbucketSet: "state",
}
_ITEMS = (upr.Mutation, upr.Deletion, upr.Expiration)
_FAST_ITEMS = frozenset(_ITEMS)
_MARKER_ACK = upr.SnapshotFlags.ACK.value
_RESPONSE = Magic.RESPONSE.value
_TAP_OPCODES = frozenset(opcode.value for opcode in TapOpcode)
_RESPONSES = (
    upr.StreamRequestOk,
    upr.StreamRequestRollback,
    upr.FailoverLogResponse,
    upr.AddStreamResponse,
    upr.Response,
)


class SessionFailed(ProtocolError):
    """The session cannot go on (upstream gone for good, a stream refused)."""


class TapSession:
    def __init__(
        self,
        conn: PacketConnection,
        plan: ConnectionPlan,
        config: SessionConfig,
        registry: Registry,
        stats: GatewayStats,
        *,
        closing_messages: tuple[TapStreamMessage, ...] = (),
        answer: Answer = refuse_command,
    ) -> None:
        self.conn = conn
        self.answer = answer
        """Answers the requests that are not TAP's (the listener's ``Door.answer``)."""
        # A TAP peer's acks are framed by body length alone, as 2.x read them.
        conn.reader.lenient_responses = True
        self.plan = plan
        self.config = config
        self.registry = registry
        self.gateway_stats = stats
        self.name = plan.name
        self.closing_messages = closing_messages
        """Sent once every stream ended and was acked (a push ends with CLOSE_TAP_STREAM)."""
        self.producer = TapProducer(
            support_ack=plan.support_ack,
            ack_interval=config.ack_interval,
            max_unacked=max(config.max_unacked, config.ack_interval),
            backoff=config.backoff,
        )
        upstream_name = "{}:{}".format(*config.upstream)
        self.stats = StreamStats("tap_front", plan.name, upstream_name, created=time.time())
        self.stats.ack_window = self.producer.max_unacked if plan.support_ack else 0
        keys_only = plan.has(ConnectFlags.KEYS_ONLY)
        network_order = plan.has(ConnectFlags.FIX_FLAG_BYTEORDER)
        self.vbuckets = {
            start.vbucket: VbStream(
                start,
                registry.checkpoint_ids(start.vbucket),
                keys_only=keys_only,
                network_byte_order=network_order,
                progress=self.stats.vbucket(start.vbucket),
            )
            for start in plan.starts
        }
        self.by_opaque: dict[int, VbStream] = {}
        self._fast_streams: dict[int, UprToTap] = {}
        """By stream opaque, the translators whose items may take the fast path."""
        self._opaque_of: dict[int, int] = {}
        """The stream opaque of each vbucket's current upstream stream."""
        self.upstream: UprUpstream | None = None
        self.generation = 0
        self._batch: list[bytes] = []
        self._settling = Settlement()
        self._pending: dict[int, Settlement] = {}
        self._ready: list[Settlement] = []
        self._wake = trio.Event()
        self.last_send = trio.current_time()
        self.done = False
        self.captured_in: UprRecording | None = None
        self.captured_out: TapRecording | None = None

    # -- running -------------------------------------------------------------

    async def run(self) -> None:
        with self.gateway_stats.stream(self.stats):
            try:
                async with AsyncExitStack() as captures, trio.open_nursery() as nursery:
                    await self._open_captures(captures)
                    nursery.start_soon(self._read_peer, nursery.cancel_scope)
                    nursery.start_soon(self._timers)
                    await self._pump()
                    await self._settle_all()
                    if self.closing_messages:
                        for message in self.closing_messages:
                            await self._emit(message, None)
                        await self._flush()
                        await self._settle_all()
                    # Everything reaches the socket before the close, however slow the
                    # peer reads (a dump without acks has nothing else to wait on).
                    await self.conn.drain()
                    self.done = True
                    nursery.cancel_scope.cancel()
            finally:
                if self.upstream is not None:
                    await self.upstream.aclose()
                self.registry.save()

    async def _open_captures(self, stack: AsyncExitStack) -> None:
        """With a capture directory: record what arrives from upstream and what is sent."""
        directory = self.config.capture_dir
        if directory is None:
            return
        inbound = await stack.enter_async_context(
            open_recorder(directory, side="upr", connection=self.name, direction="received")
        )
        outbound = await stack.enter_async_context(
            open_recorder(directory, side="tap", connection=self.name, direction="sent")
        )
        # Without the expiry opcode a 3.0 producer sends every delete as DELETION.
        self.captured_in = UprRecording(inbound, delete_kind=Kind.DELETE)
        self.captured_out = TapRecording(outbound)

    async def _pump(self) -> None:
        for message in self._opening_messages():
            await self._emit(message, None)
        await self._flush()
        failures = 0
        while not all(vb.ended for vb in self.vbuckets.values()):
            try:
                self.upstream = await self._connect()
                failures = 0
                await self._request_streams()
                while not all(vb.ended for vb in self.vbuckets.values()):
                    await self.upstream.receive()
                    await self._on_upstream_data()
                    await self._flush()
            except UpstreamError as exc:
                failures += 1
                await self._upstream_lost(exc, failures)
        for vb in self.vbuckets.values():
            for message in vb.translator.finish():
                await self._emit(message, vb)
        await self._flush()

    def _opening_messages(self) -> list[TapStreamMessage]:
        out: list[TapStreamMessage] = []
        if self.plan.support_ack:
            out.append(TapOpaque(OpaqueCode.ENABLE_AUTO_NACK))
        if self.plan.has(ConnectFlags.CHECKPOINT):
            out.append(TapOpaque(OpaqueCode.ENABLE_CHECKPOINT_SYNC))
        return out

    async def _connect(self) -> UprUpstream:
        config = self.config
        host, port = config.upstream
        self.generation += 1
        upstream = await UprUpstream.connect(
            host,
            port,
            name=b"tapfront:" + self.name.encode(),
            dialect=config.dialect,
            buffer_size=config.buffer_size,
            user=config.user,
            password=config.password,
            ssl_context=config.ssl_context,
        )
        self.stats.buffer_size = upstream.window.buffer_size
        return upstream

    async def _upstream_lost(self, exc: UpstreamError, failures: int) -> None:
        """Flush what was translated, then wait before the next attempt."""
        attempts = self.config.reconnect_attempts
        await self._flush()
        if self.upstream is not None:
            await self.upstream.aclose()
            self.upstream = None
            self.gateway_stats.upstream_reconnects_total[self.stats.upstream] += 1
        if attempts is not None and failures > attempts:
            raise SessionFailed(f"{self.name}: giving up on the UPR upstream: {exc}")
        delay = min(self.config.reconnect_max, self.config.reconnect_initial * 2 ** (failures - 1))
        log.warning("%s: %s; reconnecting in %.1fs", self.name, exc, delay)
        self.by_opaque.clear()
        self._fast_streams.clear()
        for vb in self.vbuckets.values():
            vb.prepare_resume()
        await trio.sleep(delay)

    async def _request_streams(self) -> None:
        upstream = self.upstream
        assert upstream is not None
        requests = []
        for vb in self.vbuckets.values():
            if vb.ended:
                continue
            opaque = upstream.next_opaque()
            self._route(opaque, vb)
            requests.append(
                upr.encode(vb.stream_request(opaque, self.plan.takeover), upstream.dialect)
            )
        await upstream.send(b"".join(requests))

    # -- upstream messages ---------------------------------------------------

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

    async def _on_upstream_data(self) -> None:
        """What one socket read brought: runs of items and plain markers take the fast
        path (frame bytes to frame bytes), anything else the events'."""
        upstream = self.upstream
        assert upstream is not None
        fast = self.captured_out is None and upstream.dialect is upr.DCP
        producer = self.producer
        while True:
            if fast:
                closing = self._fast_items(upstream)
                if closing is not None:
                    await self._close_fast(closing)
                    continue
                if not producer.can_send:
                    await self._wait_for_room()
                    continue
                marker = snapshot_marker(upstream.buffer, upstream.offset)
                if marker is not None and await self._marker_fast(upstream, *marker):
                    continue
            frame = upstream.next_frame()
            if frame is None:
                return
            await self._on_upstream_frame(frame)

    def _fast_items(self, upstream: UprUpstream) -> VbStream | None:
        """``translate_items`` from where the upstream's buffer stands, with the
        bookkeeping of ``_on_upstream_frame`` and ``_emit`` done once per run:
        returns the stream whose snapshot the run's last item ended (or None)."""
        touched: dict[int, UprToTap] = {}
        offset, credit, mutations, deletions, closing = translate_items(
            upstream.buffer,
            upstream.offset,
            self._fast_streams,
            self.producer,
            self._batch,
            touched,
        )
        upstream.offset = offset
        if not credit:
            return None
        upstream.window.unacked_bytes += credit
        settling = self._settling
        settling.credit += credit
        if not settling.arrival:
            settling.arrival = time.time()
        items_sent = self.stats.items_sent
        if mutations:
            items_sent["mutation"] += mutations
        if deletions:
            items_sent["deletion"] += deletions
        vbuckets = self.vbuckets
        settled = settling.touched
        for vbucket, translator in touched.items():
            vb = vbuckets[vbucket]
            vb.took_item(translator.last_seqno)
            settled[vbucket] = vb
            if translator is not closing:
                vb.item_done()
        return None if closing is None else vbuckets[closing.vbucket]

    async def _close_fast(self, vb: VbStream) -> None:
        """Close the snapshot ``vb``'s last item ended, as ``_emit`` of ``close()`` would."""
        if not self.producer.can_send:
            await self._wait_for_room()
        closed = close_frame(vb.translator, self.producer)
        if closed is not None:
            data, checkpoint_id = closed
            if checkpoint_id is not None:
                self.registry.checkpoint_closed(vb.vbucket, checkpoint_id, vb.position())
                self.stats.items_sent["marker"] += 1
            self._batch.append(data)
        self._settling.touched[vb.vbucket] = vb
        vb.item_done()

    async def _marker_fast(
        self, upstream: UprUpstream, opaque: int, start: int, end: int, flags: int
    ) -> bool:
        """A snapshot marker that only opens a checkpoint, as ``_on_upstream_frame``
        would take it; false (nothing done) for one the event path must take."""
        vb = self.by_opaque.get(opaque)
        if vb is None or opaque not in self._fast_streams or flags & _MARKER_ACK:
            return False
        if not self.producer.can_send:
            await self._wait_for_room()
        data = marker_frame(vb.translator, self.producer, start, end, flags)
        if data is None:
            return False
        upstream.offset += HEADER_SIZE + 20
        upstream.window.unacked_bytes += HEADER_SIZE + 20
        self._settling.credit += HEADER_SIZE + 20
        vb.took_marker(start, end, flags)
        self._batch.append(data)
        self.stats.items_sent["marker"] += 1
        self._settling.touched[vb.vbucket] = vb
        vb.item_done()
        return True

    async def _on_upstream_frame(self, frame: Frame) -> None:
        upstream = self.upstream
        assert upstream is not None
        try:
            event = upr.decode_frame(frame, upstream.dialect)
        except ProtocolError as exc:
            vb = self.by_opaque.get(frame.opaque)
            self.gateway_stats.protocol_errors_total["tap_front", "upstream_malformed"] += 1
            if vb is None or not frame.is_request:
                raise UpstreamError(f"malformed message from upstream: {exc}") from None
            log.error("%s: vbucket %d: ending the stream: %s", self.name, vb.vbucket, exc)
            await self._end_stream(vb, "malformed")
            return
        if isinstance(event, _RESPONSES):
            await self._on_response(event)
            return
        if isinstance(event, upr.Noop):
            await upstream.send_event(upr.Response(upr.Command.NOOP, event.opaque, _OK))
            return
        vb = self.by_opaque.get(event.opaque)
        if vb is None:
            raise UpstreamError(f"{event.NAME} for an unknown stream opaque {event.opaque}")
        if counts(event):
            upstream.window.unacked_bytes += frame.size
            self._settling.credit += frame.size
        if not self._settling.arrival and isinstance(event, _ITEMS):
            self._settling.arrival = time.time()
        if self.captured_in is not None:
            self.captured_in.record(event, vb.vbucket, time.time())
        if type(event) in _FAST_ITEMS and self.captured_out is None:
            await self._emit_item(event, vb)  # type: ignore[arg-type]
        else:
            for message in vb.translate(event):
                await self._emit(message, vb)
        reply = vb.reply_due(event)
        if reply is not None:
            self._settling.replies.append(upr.encode(reply, upstream.dialect))
            self._end_settlement()
        self._refresh_fast(vb)
        if isinstance(event, upr.StreamEnd):
            await self._end_stream(vb, _reason_name(event.reason))

    async def _on_response(self, response: upr.UprResponse) -> None:
        vb = self.by_opaque.get(response.opaque)
        if vb is None or response.NAME != "STREAM_REQ":
            return  # NOOP and buffer-ack answers need nothing
        if isinstance(response, upr.StreamRequestOk):
            vb.accepted(response.failover_log)
            return
        if isinstance(response, upr.StreamRequestRollback):
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
                await self._emit(message, vb)
            self._fast_streams.pop(response.opaque, None)
            upstream = self.upstream
            assert upstream is not None
            opaque = upstream.next_opaque()
            self._route(opaque, vb)
            await upstream.send_event(vb.stream_request(opaque, self.plan.takeover))
            return
        status = getattr(response, "status", -1)
        text = getattr(response, "value", b"").decode("utf-8", "replace")
        log.error(
            "%s: vbucket %d: upstream refused the stream (status 0x%02x%s)",
            self.name,
            vb.vbucket,
            status,
            f": {text}" if text else "",
        )
        await self._end_stream(vb, f"refused_0x{status:02x}")

    async def _end_stream(self, vb: VbStream, reason: str) -> None:
        vb.ended = True
        self._refresh_fast(vb)
        self.gateway_stats.stream_ends_total["tap_front", reason] += 1
        for message in vb.translator.finish():
            await self._emit(message, vb)
        if reason == "ok" and self.plan.takeover:
            self.gateway_stats.takeovers_completed_total["tap_front"] += 1

    # -- writing to the TAP peer ---------------------------------------------

    async def _wait_for_room(self) -> None:
        """Until the ack window has room, flushing what is batched first."""
        waited_from = time.monotonic()
        while not self.producer.can_send:
            # A fresh event before the flush awaits: an ack arriving meanwhile sets it.
            self._wake = trio.Event()
            await self._flush()
            if not self.producer.can_send:
                await self._wake.wait()
        self.stats.blocked_seconds += time.monotonic() - waited_from

    async def _emit_item(
        self, item: upr.Mutation | upr.Deletion | upr.Expiration, vb: VbStream
    ) -> None:
        """The fast path of an item: what ``translate`` and ``_emit`` do, frame to frame."""
        closes = vb.advance_item(item)
        if not self.producer.can_send:
            await self._wait_for_room()
        self._batch.append(stamped_item(item, vb.translator, self.producer))
        self.stats.items_sent["mutation" if type(item) is upr.Mutation else "deletion"] += 1
        self._settling.touched[vb.vbucket] = vb
        if closes:
            for message in vb.translator.close():
                await self._emit(message, vb)
        vb.item_done()

    async def _emit(self, message: TapStreamMessage, vb: VbStream | None) -> None:
        """Stamp one message into the batch, waiting for room in the ack window."""
        if not self.producer.can_send:
            await self._wait_for_room()
        if vb is not None and isinstance(message, TapCheckpointEnd):
            self.registry.checkpoint_closed(vb.vbucket, message.checkpoint_id, vb.position())
        stamped = self.producer.stamp(message)
        self._batch.append(encode(stamped))
        if self.captured_out is not None:
            self.captured_out.record(message, time.time())
        self._count(message)
        if vb is not None:
            self._settling.touched[vb.vbucket] = vb
        if type(message) is TapVbucketSet and message.state == upr.VBucketState.PENDING:
            self.gateway_stats.takeovers_started_total["tap_front"] += 1

    def _count(self, message: TapStreamMessage) -> None:
        kind = _KINDS.get(type(message))
        if kind is not None:
            self.stats.items_sent[kind] += 1

    def _end_settlement(self) -> None:
        """Attach what was gathered to the last message stamped (or settle it now)."""
        settlement, self._settling = self._settling, Settlement(self.generation)
        settlement.close(self.generation)
        if settlement.empty:
            return
        last = self.producer.last_opaque
        if self.plan.support_ack and last and self.producer.unacked:
            held = self._pending.get(last)
            if held is None:
                self._pending[last] = settlement
            else:
                held.merge(settlement)
        else:
            self._ready.append(settlement)

    async def _flush(self) -> None:
        """Write the batch (its last message asking for an ack), then settle what may be."""
        if self._batch and self.plan.support_ack:
            self._batch[-1] = self.producer.ack_request_on_last()
        self._end_settlement()
        if self._batch:
            data = b"".join(self._batch)
            self._batch.clear()
            await self.conn.send(data)
            self.stats.bytes_sent += len(data)
            self.stats.last_item_time = time.time()
            self.last_send = trio.current_time()
        ready, self._ready = self._ready, []
        for settlement in ready:
            await self._settle(settlement)
        self._update_ack_stats()

    async def _settle(self, settlement: Settlement) -> None:
        upstream = self.upstream
        if upstream is not None and settlement.generation == self.generation:
            try:
                await upstream.acknowledge(settlement.credit)
                if settlement.replies:
                    await upstream.send(b"".join(settlement.replies))
            except UpstreamError as exc:
                # The upstream died under an ack: the pump finds out on its next read
                # and reconnects. Credit and replies were owed to the lost connection
                # only (a new one starts with an empty window and fresh streams), so
                # what remains to settle is the TAP side, below, as for any ack.
                log.info("%s: upstream gone while settling an ack: %s", self.name, exc)
        for vbucket, position in settlement.positions.items():
            progress = self.stats.vbucket(vbucket)
            progress.acked_seqno = max(progress.acked_seqno, position.seqno)
            if self.plan.registered:
                self.registry.advance(self.name, vbucket, position)
        if settlement.arrival:
            self.stats.latency.observe(max(0.0, time.time() - settlement.arrival))

    def _update_ack_stats(self) -> None:
        stats = self.stats
        stats.acks_pending = self.producer.unacked
        stats.nacks_total = self.producer.nacks_total
        stats.retransmits_total = self.producer.retransmits_total
        upstream = self.upstream
        stats.unacked_bytes = upstream.window.unacked_bytes if upstream is not None else 0
        # The upstream stops once its window is full: count that time as blocked.
        full = upstream is not None and upstream.window.full
        if full and stats.blocked_since is None:
            stats.blocked_since = time.monotonic()
        elif not full and stats.blocked_since is not None:
            stats.blocked_seconds = stats.blocked_total()
            stats.blocked_since = None
        # Settlements are held in the order they were made, so the first with an
        # arrival is the oldest (a scan of all of them on every ack was quadratic).
        oldest = next((s.arrival for s in self._pending.values() if s.arrival), 0.0)
        stats.oldest_unacked_time = oldest or None

    async def _settle_all(self) -> None:
        """Wait until the peer acknowledged everything (at once without support-ack)."""
        while self.producer.unacked:
            self._wake = trio.Event()
            await self._wake.wait()

    # -- the TAP peer ----------------------------------------------------------

    async def _read_peer(self, scope: trio.CancelScope) -> None:
        conn = self.conn
        while (frame := await conn.receive_frame()) is not None:
            try:
                # The acks of one read are applied together and what they release is
                # settled in one upstream send; anything else keeps its place in order.
                acks: list[int] = []
                while frame is not None:
                    if frame.magic != _RESPONSE or frame.opcode not in _TAP_OPCODES:
                        await self._on_acks(acks)
                        await self._on_peer_request(frame)
                    elif frame.vbucket_or_status:
                        await self._on_acks(acks)
                        await self._settle_acked(self._on_ack(frame))
                    else:
                        acks.append(frame.opaque)
                    frame = conn.next_buffered_frame()
                await self._on_acks(acks)
            except ProtocolError as exc:
                kind = "refused_ack" if exc.field in ("status", "opaque") else "malformed"
                self.gateway_stats.protocol_errors_total["tap_front", kind] += 1
                raise
        log.info("%s: TAP peer closed the connection", self.name)
        scope.cancel()

    async def _on_peer_request(self, frame: Frame) -> None:
        if frame.magic != _RESPONSE and not is_tap_opcode(frame.opcode):
            await self.answer(self.conn, frame)  # memcached's own commands
            return
        event = decode_frame(frame)
        if isinstance(event, TapNoop):
            await self.conn.send(encode(TapNoopResponse(event.opaque)))
        elif not isinstance(event, TapNoopResponse):
            raise ProtocolError(
                f"{event.NAME} is not allowed from the TAP peer of a stream",
                opcode=frame.opcode,
                status=Status.NOT_SUPPORTED,
            )

    async def _on_acks(self, opaques: list[int]) -> None:
        """Apply the successful acks read so far, in order, and settle what they released."""
        if not opaques:
            return
        producer = self.producer
        first = producer.first_unacked
        count = producer.release_acks(opaques)
        opaques.clear()
        self._wake.set()
        await self._settle_acked(self._released(first, count))

    def _released(self, first: int, count: int) -> list[Settlement]:
        """The settlements held on the ``count`` messages acked from ``first`` on."""
        released: list[Settlement] = []
        pending = self._pending
        # Settlements wait in the order of their messages' sequence numbers.
        while count and pending:
            opaque = next(iter(pending))
            if (opaque - first) % SEQNO_MODULUS >= count:
                break
            released.append(pending.pop(opaque))
        return released

    def _on_ack(self, frame: Frame) -> list[Settlement]:
        """Apply a TAP ack or nack (a response to a stream message, framed as 2.x
        framed them: only opaque and status count, the body is a nack's text);
        the settlements it released, oldest first."""
        producer = self.producer
        status = frame.vbucket_or_status
        first = producer.first_unacked
        count = producer.release(
            frame.opaque, status, trio.current_time() if status else 0.0, frame.body, frame.opcode
        )
        if status and producer.state is ProducerState.BACKING_OFF:
            log.info("%s: TAP peer busy (0x%02x): backing off", self.name, status)
        self._wake.set()
        return self._released(first, count)

    async def _settle_acked(self, settlements: list[Settlement]) -> None:
        """Settle what acks released (the upstream's credit and replies in one send)."""
        if settlements:
            batch = Settlement(self.generation)
            now = time.time()
            for settlement in settlements:
                batch.merge(settlement)
                if settlement.arrival:
                    self.stats.latency.observe(max(0.0, now - settlement.arrival))
            batch.arrival = 0.0
            settlements.clear()
            await self._settle(batch)
        self._update_ack_stats()

    async def _timers(self) -> None:
        while True:
            deadline = self.last_send + self.config.noop_interval
            retransmit = self.producer.next_deadline()
            if retransmit is not None:
                deadline = min(deadline, retransmit)
            await trio.sleep_until(deadline)
            now = trio.current_time()
            backing_off = self.producer.state is ProducerState.BACKING_OFF
            again = self.producer.retransmit_frames(now)
            if again:
                log.info("%s: resending %d unacked messages", self.name, len(again))
                await self.conn.send(b"".join(again))
                self.last_send = now
                self._update_ack_stats()
            if backing_off and self.producer.state is ProducerState.STREAMING:
                self._wake.set()  # the pump may go on, after the resend (if any)
            elif now >= self.last_send + self.config.noop_interval:
                await self.conn.send(encode(TapNoop()))
                self.last_send = now


def _reason_name(reason: int) -> str:
    try:
        return upr.StreamEndReason(reason).name.lower()
    except ValueError:
        return f"reason_{reason}"
