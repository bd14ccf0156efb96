"""The TAP peer's side of a session: batches out, acks in, settlements upstream.

Theory of operation. ``TapPeer`` stamps TAP messages with the sans-IO
``TapProducer`` (sequence numbers, ack requests, the unacked window) into a
batch that ``flush`` writes with one send, its last message asking for an
ack. Which acks settle what is ``adapters.tap.settlement``'s rule
(``Settlements``): each batch's upstream bytes, the replies the upstream
waits for and the positions reached gather in a ``Settlement`` attached to
the batch's last message; ``read`` hands it the peer's acks and nacks
(framed by body length alone, as memcached 2.x read them) and sends what
they release: credit and replies to the upstream connection they were owed
to (``upstream``, set by the session), positions and counters on the TAP
side. A request that is not TAP's goes to the front's
command door (``answer``), as 2.x memcached ran every packet of a TAP
connection through its command dispatcher (daemon/memcached.c
``conn_ship_log``). ``timers`` sends a NOOP on an idle connection and
resends after a busy nack.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext as nowhere

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import HEADER_SIZE, Frame, FrameReader, Magic, Status
from adapters.tap import (
    TapCheckpointEnd,
    TapCheckpointStart,
    TapDelete,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpcode,
    TapStreamMessage,
    TapVbucketSet,
    decode_frame,
    encode,
)
from adapters.tap.codec import is_tap_opcode
from adapters.tap.producer import ProducerState, TapProducer, successful_acks
from adapters.tap.settlement import Settlement, Settlements
from gateway.fronts.tap.plan import ConnectionPlan
from gateway.fronts.tap.registry import Registry, VbResume
from gateway.fronts.tap.upstream import UprUpstream, UprUpstreamError
from gateway.fronts.tap.vbstream import VbStream
from gateway.io.connection import PacketConnection
from gateway.io.door import Answer
from gateway.metrics.figures import GatewayStats, StreamStats
from gateway.tools.capture.mapping import TapRecording

__all__ = ["TapPeer"]

log = logging.getLogger(__name__)

_KINDS: dict[type, str] = {
    TapMutation: "mutation",
    TapDelete: "deletion",
    TapCheckpointStart: "marker",
    TapCheckpointEnd: "marker",
    TapVbucketSet: "state",
}
_RESPONSE = Magic.RESPONSE.value
_TAP_OPCODES = frozenset(opcode.value for opcode in TapOpcode)
_SOME_ACKS = 2 * HEADER_SIZE
"""Buffered bytes worth scanning for acks in place (fewer: the reader frames them)."""


def _take_acks(reader: FrameReader, acks: list[int]) -> None:
    """The successful acks buffered in ``reader`` next, without a ``Frame`` each: at
    live rates a peer with the CHECKPOINT flag acks two checkpoint messages per
    item (2.x asked for an ack on each), and framing every ack cost more than
    the rest of its read."""
    data = reader.take_buffered()
    taken = successful_acks(data, 0, acks, reader.max_frame_size)
    reader.consumed += taken
    if taken < len(data):
        reader.receive_data(memoryview(data)[taken:])


class TapPeer:
    def __init__(
        self,
        conn: PacketConnection,
        producer: TapProducer,
        plan: ConnectionPlan,
        registry: Registry,
        stats: StreamStats,
        gateway_stats: GatewayStats,
        *,
        noop_interval: float,
        answer: Answer,
    ) -> None:
        self.conn = conn
        # A TAP peer's acks are framed by body length alone, as 2.x read them.
        conn.reader.lenient_responses = True
        self.producer = producer
        self.plan = plan
        self.name = plan.name
        # Asked once per batch: a plain bool, not Flag arithmetic.
        self._support_ack = plan.support_ack
        self.registry = registry
        self.stats = stats
        self.gateway_stats = gateway_stats
        self.noop_interval = noop_interval
        self.answer = answer
        """Answers the requests that are not TAP's (the listener's ``Door.answer``)."""
        self.upstream: UprUpstream | None = None
        """The upstream connection the credit and replies settled now are owed to."""
        self.settlements: Settlements[VbResume] = Settlements(
            producer, support_ack=plan.support_ack, registered=plan.registered
        )
        """What each batch settles (the session counts upstream connections there)."""
        self.batch: list[bytes] = []
        self.wake = trio.Event()
        """Set by an ack or the end of a backoff: room may have come in the ack window."""
        self.last_send = trio.current_time()
        self.captured_out: TapRecording | None = None
        self._stray_acks = 0

    # -- writing -------------------------------------------------------------

    async def wait_for_room(self) -> None:
        """Until the ack window has room, flushing what is batched first (the upstream's
        keeper answers its NOOPs meanwhile: ``UprUpstream.pump_away``)."""
        waited_from = time.monotonic()
        upstream = self.upstream
        with nowhere() if upstream is None else upstream.pump_away():
            while not self.producer.can_send:
                # A fresh event before the flush awaits: an ack arriving meanwhile sets it.
                self.wake = trio.Event()
                await self.flush()
                if not self.producer.can_send:
                    await self.wake.wait()
        self.stats.blocked_seconds += time.monotonic() - waited_from

    async def emit(self, message: TapStreamMessage, vb: VbStream | None) -> None:
        """Stamp one message into the batch, waiting for room in the ack window."""
        if not self.producer.can_send:
            await self.wait_for_room()
        if vb is not None and isinstance(message, TapCheckpointEnd):
            self.registry.checkpoint_closed(vb.vbucket, message.checkpoint_id, vb.position())
        stamped = self.producer.stamp(message)
        self.batch.append(encode(stamped))
        if self.captured_out is not None:
            self.captured_out.record(message, time.time())
        kind = _KINDS.get(type(message))
        if kind is not None:
            self.stats.items_sent[kind] += 1
        if vb is not None:
            self.settlements.settling.touched[vb.vbucket] = vb
        if type(message) is TapVbucketSet and message.state == upr.VBucketState.PENDING:
            self.gateway_stats.takeovers_started_total["tap_front"] += 1

    async def flush(self) -> None:
        """Write the batch (its last message asking for an ack), then settle what may be."""
        if self.batch and self._support_ack:
            self.batch[-1] = self.producer.ack_request_on_last()
        self.settlements.end()
        if self.batch:
            data = b"".join(self.batch)
            self.batch.clear()
            upstream = self.upstream
            if upstream is not None and not self.conn.outbox_room:
                with upstream.pump_away():  # a peer that does not read: send waits
                    await self.conn.send(data)
            else:
                await self.conn.send(data)
            self.stats.bytes_sent += len(data)
            self.stats.last_item_time = time.time()
            self.last_send = trio.current_time()
        for settlement in self.settlements.take_ready():
            await self._settle(settlement)
        self.update_ack_stats()

    async def settle_all(self) -> None:
        """Wait until the peer acknowledged everything (at once without support-ack)."""
        while self.producer.unacked:
            self.wake = trio.Event()
            await self.wake.wait()

    async def _settle(self, settlement: Settlement[VbResume]) -> None:
        upstream = self.upstream
        if upstream is not None and self.settlements.owed_upstream(settlement):
            try:
                await upstream.acknowledge(settlement.credit)
                if settlement.replies:
                    await upstream.send(b"".join(settlement.replies))
            except UprUpstreamError as exc:
                # The upstream died under an ack: the pump finds out on its next read
                # and reconnects. Credit and replies were owed to the lost connection
                # only (a new one starts with an empty window and fresh streams), so
                # what remains to settle is the TAP side, below, as for any ack.
                log.info("%s: upstream gone while settling an ack: %s", self.name, exc)
        vbucket_stats = self.stats.vbucket
        for vbucket, seqno in settlement.seqnos.items():
            progress = vbucket_stats(vbucket)
            if seqno > progress.acked_seqno:
                progress.acked_seqno = seqno
        for vbucket, position in settlement.positions.items():
            progress = vbucket_stats(vbucket)
            progress.acked_seqno = max(progress.acked_seqno, position.seqno)
            self.registry.advance(self.name, vbucket, position)
        if settlement.arrival:
            self.stats.latency.observe(max(0.0, time.time() - settlement.arrival))

    def update_ack_stats(self) -> None:
        stray = self.producer.stray_acks
        if stray != self._stray_acks:
            # Ignored, as 2.x did ("Explicit ack of nonexisting entry"), but said:
            # once per connection in the log (a client may send many), all counted.
            if not self._stray_acks:
                log.warning(
                    "%s: ignored an ack of a sequence number never sent (further ones "
                    'are counted in tapupr_protocol_errors_total{kind="stray_ack"})',
                    self.name,
                )
            self.gateway_stats.protocol_errors_total["tap_front", "stray_ack"] += (
                stray - self._stray_acks
            )
            self._stray_acks = stray
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
        stats.oldest_unacked_time = self.settlements.oldest_arrival() or None

    # -- reading -------------------------------------------------------------

    async def read(self, scope: trio.CancelScope) -> None:
        """Read the peer until it closes (then cancel ``scope``)."""
        conn = self.conn
        reader = conn.reader
        while (frame := await conn.receive_frame()) is not None:
            try:
                # The acks of one read are applied together and what they release is
                # settled in one upstream send; anything else keeps its place in order.
                acks: list[int] = []
                while frame is not None:
                    if frame.magic != _RESPONSE or frame.opcode not in _TAP_OPCODES:
                        await self._on_acks(acks)
                        await self._on_request(frame)
                    elif frame.vbucket_or_status:
                        await self._on_acks(acks)
                        await self._settle_acked(self._on_ack(frame))
                    else:
                        acks.append(frame.opaque)
                        if reader.buffered >= _SOME_ACKS:
                            _take_acks(reader, acks)
                    frame = conn.next_buffered_frame()
                await self._on_acks(acks)
            except ProtocolError as exc:
                kind = "refused_ack" if exc.field in ("status", "opaque") else "malformed"
                self.gateway_stats.protocol_errors_total["tap_front", kind] += 1
                raise
        log.info("%s: TAP peer closed the connection", self.name)
        scope.cancel()

    async def _on_request(self, frame: Frame) -> None:
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
        released = self.settlements.acked(opaques)
        self.wake.set()
        await self._settle_acked(released)

    def _on_ack(self, frame: Frame) -> list[Settlement[VbResume]]:
        """Apply a TAP ack or nack (a response to a stream message, framed as 2.x
        framed them: only opaque and status count, the body is a nack's text);
        the settlements it released, oldest first."""
        status = frame.vbucket_or_status
        released = self.settlements.answered(
            frame.opaque, status, trio.current_time() if status else 0.0, frame.body, frame.opcode
        )
        if status and self.producer.state is ProducerState.BACKING_OFF:
            log.info("%s: TAP peer busy (0x%02x): backing off", self.name, status)
        self.wake.set()
        return released

    async def _settle_acked(self, settlements: list[Settlement[VbResume]]) -> None:
        """Settle what acks released (the upstream's credit and replies in one send)."""
        if settlements:
            now = time.time()
            for settlement in settlements:
                if settlement.arrival:
                    self.stats.latency.observe(max(0.0, now - settlement.arrival))
            await self._settle(self.settlements.combined(settlements))
        self.update_ack_stats()

    # -- timers --------------------------------------------------------------

    async def timers(self) -> None:
        """NOOP an idle connection; resend what a busy nack held back."""
        while True:
            deadline = self.last_send + self.noop_interval
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
                self.update_ack_stats()
            if backing_off and self.producer.state is ProducerState.STREAMING:
                self.wake.set()  # the pump may go on, after the resend (if any)
            elif now >= self.last_send + self.noop_interval:
                await self.conn.send(encode(TapNoop()))
                self.last_send = now
