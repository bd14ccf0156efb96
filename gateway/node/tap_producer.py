"""TAP producer connections of the reference node, as an ep-engine 2.x node runs them.

Theory of operation. ``serve_tap_stream`` takes over a connection after its
CONNECT. ``tap_plan.plan_stream`` turns the CONNECT into one cursor per
vbucket; a refused CONNECT gets NOT_SUPPORTED with a message and the
connection closes. One ``TapStream`` then runs three tasks:

- the producer (``_produce``), the only task that writes stream messages:
  OPAQUE(ENABLE_AUTO_NACK) with support-ack, OPAQUE(ENABLE_CHECKPOINT_SYNC)
  with checkpoint; for a takeover VBUCKET_SET(pending) per vbucket; the
  backfills, each OPAQUE(INITIAL_VBUCKET_STREAM), the items,
  OPAQUE(CLOSE_BACKFILL) (a DUMP too, for every ACTIVE vbucket that holds
  items, as 2.x's ``registerCursor`` scheduled a dump as a backfill of
  those; the others send nothing); then live items,
  grouped by the checkpoint each was written in, between CHECKPOINT_START
  and CHECKPOINT_END when the client set the CHECKPOINT flag (without it
  the items alone, as 2.x sent them). A DUMP ends after its backfill; a takeover, once every
  vbucket is caught up and (with support-ack) the client has acked it all,
  makes each vbucket DEAD, sends what the last writes left and
  VBUCKET_SET(active). Both then wait for every ack and close;
- the reader (``_read_responses``): acks and nacks go to the sans-IO
  ``TapProducer`` (sequence numbers, ack requests, window, backoff and
  retransmit, fatal nacks); a malformed packet gets an error and closes. A
  request that is not TAP's (STAT, VERSION, GET, an unknown opcode) goes to
  the node's command door and is answered between stream messages, as 2.x
  memcached ran every packet of a TAP connection through its command
  dispatcher (daemon/memcached.c ``conn_ship_log``);
  Responses are framed by body length alone, as memcached 2.x read them:
  the classic 2.x client acks with the request's key length and extras
  length 8 or 16 over an empty body (see ``adapters.mcbp.frames``);
- the watcher: wakes the producer on any store change.

Both directions dispatch by table: ``_SENDING`` says what each message the
producer sends waits for (with ``tap_wait_control_acks``) and records once
stamped; ``_RECEIVED`` what the reader does with each TAP packet.

The producer reads the store in bounded batches and awaits each send, so a
slow client pushes back through the socket outbox and, with support-ack,
through the ack window. With support-ack, the last message before it
catches up asks for an ack too (as 2.x did), so a client that acks only
when asked still confirms everything. With nothing to send it sleeps until
a change, an ack, a retransmit deadline or the NOOP interval, whichever
comes first; an idle stream gets a memcached NOOP every
``tap_noop_interval``. A support-ack client whose window stays full with no
ack for ``tap_ack_grace_period`` is disconnected, as 2.x's
``TapConnMap::notifyIOThreadMain`` did. With ``tap_wait_control_acks`` a
support-ack stream sends nothing but OPAQUE and VBUCKET_SET while an OPAQUE
is unacked, and no item while a checkpoint message is, as 2.x did (off by
default: the node's window tests read a lazy acker's stream up to the window).

Item messages come from ``adapters.tap.item_messages``, the builder the TAP
front uses too: flags as stored with FIX_FLAG_BYTEORDER (and the TAP flag
NETWORK_BYTE_ORDER), byte-swapped to 2.x's little-endian host order without
it; deletions and expirations both DELETE. Engine-specific data: rev_seqno,
plus nru on mutations (the store keeps no NRU bits: 2.x's initial value is
sent).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import trio

from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Status, error_response
from adapters.tap import (
    ConnectFlags,
    OpaqueCode,
    TapCheckpointEnd,
    TapCheckpointStart,
    TapConnect,
    TapDelete,
    TapMutation,
    TapNoop,
    TapNoopResponse,
    TapOpaque,
    TapResponse,
    TapStreamMessage,
    TapVbucketSet,
    decode_frame,
    encode,
)
from adapters.tap.codec import is_tap_opcode
from adapters.tap.connect import connect_refusal
from adapters.tap.item_messages import ItemMessages
from adapters.tap.producer import SEQNO_MODULUS, ProducerState, TapProducer
from adapters.tap.settlement import Settlement, Settlements
from gateway.io.connection import PacketConnection
from gateway.io.replies import send_refusal
from gateway.node.items import Item, VBucketState
from gateway.node.tap_figures import connection_figures, takeover_stats
from gateway.node.tap_plan import Phase, StreamPlan, VbCursor, plan_stream
from gateway.node.tap_registry import Registration, TapHub, VbPosition

__all__ = ["TapHub", "TapStream", "serve_tap_stream"]  # the node builds TapHub from here

log = logging.getLogger(__name__)

BATCH = 256
"""Items read from the store at a time."""
TAKEOVER_SETTLE_ROUNDS = 3
"""Times a takeover waits for every ack and catches up again before going dead."""
INITIAL_NRU = 2
_U64 = struct.Struct(">Q")
"""ep-engine 2.x's NRU value of an item not referenced since it was stored."""


def item_message(messages: ItemMessages, item: Item) -> TapStreamMessage:
    """What the node sends for one stored item version (the store keeps no NRU bits)."""
    if item.deleted:
        return messages.deletion(item, item.vbucket)
    return messages.mutation(item, item.vbucket, INITIAL_NRU)


async def serve_tap_stream(
    node: Any, conn: PacketConnection, frame: Frame, connect: TapConnect
) -> None:
    """Run the TAP producer for the rest of the connection (``connect`` decoded
    from ``frame``, which a refusal answers)."""
    # From here on the peer is a TAP client: 2.x framed its acks by body length alone.
    conn.reader.lenient_responses = True
    hub: TapHub = node.tap
    name = hub.connection_name(connect.name)
    registration = None
    if connect.connect_flags & ConnectFlags.REGISTERED_CLIENT:
        if hub.holds(name):
            # 2.x refused a registered client whose name was streaming; the first goes on.
            refused = connect_refusal(
                f"TAP client {name!r} is already connected", field="key", value=connect.name
            )
            await send_refusal(conn, error_response(frame, refused))
            raise refused
        registration = hub.registration(name)
    try:
        plan = plan_stream(connect, name, node.store, registration, time.time())
    except ProtocolError as exc:
        await send_refusal(conn, error_response(frame, exc))
        raise
    if plan.registered:
        registration = hub.register(name)
    stream = TapStream(node, conn, plan, registration)
    with hub.running(stream):
        await stream.run()


class TapStream:
    """One TAP producer connection (see the module docstring)."""

    def __init__(
        self,
        node: Any,
        conn: PacketConnection,
        plan: StreamPlan,
        registration: Registration | None,
    ) -> None:
        config = node.config
        self.node = node
        self.store = node.store
        self.conn = conn
        self.plan = plan
        self.name = plan.name
        self.registration = registration
        self.cursors = {cursor.vb: cursor for cursor in plan.cursors}
        self.producer = TapProducer(
            support_ack=plan.support_ack,
            ack_interval=config.tap_ack_interval,
            max_unacked=max(config.tap_max_unacked, config.tap_ack_interval),
            backoff=config.tap_backoff,
        )
        self.noop_interval: float = config.tap_noop_interval
        self.ack_grace: float = config.tap_ack_grace_period
        self.last_ack = trio.current_time()
        """When the client last answered (an ack or a nack), or connected."""
        self.wait_control_acks = plan.support_ack and config.tap_wait_control_acks
        self._control_sent: int | None = None
        self._checkpoint_sent: int | None = None
        """Sequence numbers of the last OPAQUE and checkpoint message sent."""
        self.checkpoint_sync = plan.has(ConnectFlags.CHECKPOINT)
        """CHECKPOINT_START/END go out only to a client that asked for them (2.5.1
        tapconnection.cc: ``supportCheckpointSync_``, set by the CHECKPOINT flag)."""
        self.item_messages = ItemMessages(
            keys_only=plan.has(ConnectFlags.KEYS_ONLY),
            network_byte_order=plan.has(ConnectFlags.FIX_FLAG_BYTEORDER),
        )
        self.created = time.time()
        self.last_send = trio.current_time()
        self._wake = trio.Event()
        # Positions a registered client reaches once the message is acked.
        self.settlements: Settlements[VbPosition] = Settlements(
            self.producer, support_ack=plan.support_ack, registered=True
        )
        self.items_sent = 0
        self.deletes_sent = 0
        self.checkpoint_ends = 0
        self.noops_sent = 0
        self.last_stamped = 0
        self.idle = False

    # -- running -------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_responses, nursery.cancel_scope)
            nursery.start_soon(self._watch_changes)
            await self._produce()
            await self.conn.drain()  # a slow reader still gets the whole dump
            nursery.cancel_scope.cancel()

    async def _produce(self) -> None:
        plan = self.plan
        if plan.support_ack:
            await self._emit(TapOpaque(OpaqueCode.ENABLE_AUTO_NACK))
        if plan.has(ConnectFlags.CHECKPOINT):
            await self._emit(TapOpaque(OpaqueCode.ENABLE_CHECKPOINT_SYNC))
        if plan.takeover:
            for cursor in plan.cursors:
                await self._emit(TapVbucketSet(VBucketState.PENDING, cursor.vb))
        for cursor in plan.cursors:
            if cursor.phase is Phase.BACKFILL:
                await self._backfill(cursor)
        if not plan.dump:
            await self._live()
            if plan.takeover:
                await self._take_over()
        await self._settle()

    async def _watch_changes(self) -> None:
        while True:
            await self.node.changes.wait_any()
            self._wake.set()

    # -- phases --------------------------------------------------------------

    async def _backfill(self, cursor: VbCursor) -> None:
        vb = cursor.vb
        dump = self.plan.dump
        cursor.backfill_end = end = self.store.high_seqno(vb)
        if dump and not self._dumps(cursor, end):
            cursor.phase = Phase.DONE
            return
        if cursor.reset:
            await self._emit(
                TapOpaque(OpaqueCode.INITIAL_VBUCKET_STREAM, vb), VbPosition(0, 0, False)
            )
        while batch := self.store.items_since(vb, cursor.seqno, end, BATCH):
            for index, item in enumerate(batch):
                position = VbPosition(item.by_seqno, 0, False)
                last = index == len(batch) - 1 and self._caught_up(vb, item.by_seqno, end)
                await self._emit(self._item_message(item), position, last=last)
                cursor.seqno = item.by_seqno
        # Later versions of the rest moved past ``end``: live sends them.
        cursor.seqno = max(cursor.seqno, end)
        await self._emit(
            TapOpaque(OpaqueCode.CLOSE_BACKFILL, vb), VbPosition(cursor.seqno, 0, True)
        )
        cursor.phase = Phase.LIVE if not dump else Phase.DONE

    def _dumps(self, cursor: VbCursor, end: int) -> bool:
        """Whether a DUMP sends this vbucket: 2.x dumped ACTIVE vbuckets holding
        items and sent nothing at all, not even the OPAQUEs, for the others
        (a registered client's unfinished dump goes on regardless)."""
        vb = cursor.vb
        if not cursor.reset:
            return True
        return self.store.state(vb) is VBucketState.ACTIVE and not self._caught_up(
            vb, cursor.seqno, end
        )

    async def _live(self) -> None:
        """Stream changes; returns only for a takeover, once all is caught up."""
        settled = 0
        while True:
            self._wake = trio.Event()  # before reading, so no change slips by
            progressed = False
            for cursor in self.plan.cursors:
                progressed = await self._live_step(cursor) or progressed
            if progressed:
                self.idle = False
                continue
            if self.plan.takeover:
                # Go dead only once the client holds what was sent (a short
                # dead window), but do not chase a busy writer for ever.
                if not self.producer.unacked or settled == TAKEOVER_SETTLE_ROUNDS:
                    return
                settled += 1
                await self._settle()
                continue
            self.idle = self.producer.unacked == 0
            await self._pause()

    async def _live_step(self, cursor: VbCursor) -> bool:
        """Send one batch of ``cursor``'s vbucket; whether anything went out."""
        vb = cursor.vb
        store = self.store
        high = store.high_seqno(vb)
        if high < cursor.seqno:
            log.info("%s: vbucket %d went back to seqno %d; restreaming", self.name, vb, high)
            cursor.seqno, cursor.checkpoint, cursor.reset = 0, None, True
            await self._backfill(cursor)
            return True
        batch = store.items_since(vb, cursor.seqno, high, BATCH) if high > cursor.seqno else []
        for index, item in enumerate(batch):
            if item.checkpoint_id != cursor.checkpoint:
                await self._end_checkpoint(cursor)
                cursor.checkpoint = item.checkpoint_id
                if self.checkpoint_sync:
                    await self._emit(self._checkpoint_start(item.checkpoint_id, vb))
            position = VbPosition(item.by_seqno, item.checkpoint_id)
            last = index == len(batch) - 1 and self._caught_up(vb, item.by_seqno)
            await self._emit(self._item_message(item), position, last=last)
            cursor.seqno = item.by_seqno
        if batch:
            return True
        cursor.seqno = high  # only overwritten versions were left
        if cursor.checkpoint is not None and cursor.checkpoint < store.checkpoints(vb)[-1].id:
            await self._end_checkpoint(cursor)
            return True
        return False

    def _checkpoint_start(self, checkpoint_id: int, vb: int) -> TapCheckpointStart:
        """With the vbucket's max deleted rev_seqno as engine-specific bytes, as 2.x sent
        it (ep_engine.cc ``doWalkTapQueue``) and its consumers read it."""
        vbucket = self.store.vbucket(vb)
        deleted_rev = vbucket.max_deleted_rev if vbucket is not None else 0
        return TapCheckpointStart(checkpoint_id, vb, engine_specific=_U64.pack(deleted_rev))

    def _caught_up(self, vb: int, seqno: int, end: int | None = None) -> bool:
        """Nothing left to send in ``vb`` after ``seqno`` (up to ``end``)."""
        return not self.store.items_since(vb, seqno, end, 1)

    async def _end_checkpoint(self, cursor: VbCursor) -> None:
        if cursor.checkpoint is None:
            return
        checkpoint, cursor.checkpoint = cursor.checkpoint, None
        if not self.checkpoint_sync:
            return
        self.checkpoint_ends += 1
        position = VbPosition(cursor.seqno, checkpoint)
        await self._emit(TapCheckpointEnd(checkpoint, cursor.vb), position)

    async def _take_over(self) -> None:
        """Each vbucket: DEAD here, its last items, then VBUCKET_SET(active)."""
        for cursor in self.plan.cursors:
            # Told to UPR streams, unlike a UPR takeover's: 3.0 tapconnection.cc
            # calls ``setVBucketState(vb, dead, false)``, ``notify_upr`` left true.
            self.store.set_state(cursor.vb, VBucketState.DEAD, now=time.time())
            while await self._live_step(cursor):
                pass
            await self._emit(TapVbucketSet(VBucketState.ACTIVE, cursor.vb))
            cursor.phase = Phase.DONE

    async def _settle(self) -> None:
        """Wait until every message is acked (at once without support-ack).

        No keep-alive once the last ack is in: the connection closes next,
        and a NOOP the client answers after that close would reach a closed
        socket, so the client's kernel would see a reset instead of the end.
        """
        while self.producer.unacked:
            self._wake = trio.Event()
            await self._pause(unless_settled=True)

    # -- sending -------------------------------------------------------------

    def _item_message(self, item: Item) -> TapStreamMessage:
        if item.deleted:
            self.deletes_sent += 1
        return item_message(self.item_messages, item)

    async def _emit(
        self, message: TapStreamMessage, position: VbPosition | None = None, *, last: bool = False
    ) -> None:
        """Stamp and send one message, waiting for the ack window first.

        ``last``: nothing more to send in this vbucket for now; as 2.x did,
        ask for an ack, so a client that acks only when asked confirms it all.
        """
        sending = _SENDING[type(message)]
        if self.wait_control_acks:
            await sending.held(self)
        while not self.producer.can_send:
            self._wake = trio.Event()
            await self._pause(expires=self._window_expiry())
            self._check_window()
        stamped = self.producer.stamp(message, force_ack=last)
        self.last_stamped = stamped.opaque
        sending.stamped(self, stamped.opaque)
        if position is not None and self.registration is not None:
            settlements = self.settlements
            settlements.settling.positions[message.vbucket] = position
            settlements.end()
            self._settled(settlements.take_ready())
        await self.conn.send(encode(stamped))
        self.last_send = trio.current_time()

    # 2.x sends nothing but OPAQUE and VBUCKET_SET while an OPAQUE is unacked
    # (ep_engine.cc ``doWalkTapQueue``: ``waitForOpaqueMsgAck``), nor an item while
    # a checkpoint message is (``getNextItem``: ``waitForCheckpointMsgAck``).

    async def _held_by_nothing(self) -> None:
        pass

    async def _held_by_control(self) -> None:
        await self._until_acked(self._control_sent)

    async def _held_by_control_and_checkpoint(self) -> None:
        await self._until_acked(self._control_sent)
        await self._until_acked(self._checkpoint_sent)

    def _control_stamped(self, seqno: int) -> None:
        self._control_sent = seqno

    def _checkpoint_stamped(self, seqno: int) -> None:
        self._checkpoint_sent = seqno

    def _item_stamped(self, _seqno: int) -> None:
        self.items_sent += 1

    def _state_stamped(self, _seqno: int) -> None:
        pass

    def _acked(self, seqno: int | None) -> bool:
        """The message stamped ``seqno`` is acked (an ack covers all before it)."""
        oldest = self.producer.oldest_unacked
        if seqno is None or oldest is None:
            return True
        return 0 < (oldest.opaque - seqno) % SEQNO_MODULUS < SEQNO_MODULUS // 2

    async def _until_acked(self, seqno: int | None) -> None:
        while not self._acked(seqno):
            self._wake = trio.Event()
            await self._pause()

    def _window_expiry(self) -> float | None:
        """When a full ack window drops the client (None: the window has room)."""
        producer = self.producer
        if not self.plan.support_ack or producer.unacked < producer.max_unacked:
            return None
        return self.last_ack + self.ack_grace

    def _check_window(self) -> None:
        """2.x's ``TapConnMap::notifyIOThreadMain``: a support-ack client whose window
        is full and whose last ack is older than the grace is disconnected."""
        expiry = self._window_expiry()
        if expiry is not None and trio.current_time() >= expiry:
            raise ProtocolError(
                f"TAP client {self.name!r}: ack window full ({self.producer.unacked} "
                f"unacked) and no ack for {self.ack_grace:g}s (tap_ack_grace_period)",
                field="ack",
                value=self.producer.unacked,
            )

    async def _pause(self, *, unless_settled: bool = False, expires: float | None = None) -> None:
        """Sleep until woken or the next deadline (``expires`` one too); then do what
        fell due (nothing when ``unless_settled`` and every message is now acked)."""
        deadline = self.last_send + self.noop_interval
        retransmit = self.producer.next_deadline()
        if retransmit is not None:
            deadline = min(deadline, retransmit)
        if expires is not None:
            deadline = min(deadline, expires)
        with trio.move_on_at(deadline):
            await self._wake.wait()
        if unless_settled and not self.producer.unacked:
            return
        await self._on_timers()

    async def _on_timers(self) -> None:
        now = trio.current_time()
        again = self.producer.retransmit_due(now)
        if again:
            log.info("%s: resending %d unacked messages", self.name, len(again))
            await self.conn.send(b"".join(encode(message) for message in again))
            self.last_send = now
        elif now >= self.last_send + self.noop_interval:
            self.noops_sent += 1
            await self.conn.send(encode(TapNoop()))
            self.last_send = now

    # -- receiving -----------------------------------------------------------

    async def _read_responses(self, scope: trio.CancelScope) -> None:
        conn = self.conn
        answer = self.node.door.answer
        while (frame := await conn.receive_frame()) is not None:
            if frame.is_request and not is_tap_opcode(frame.opcode):
                await answer(conn, frame)  # memcached's own commands
                continue
            try:
                event = decode_frame(frame)
            except ProtocolError as exc:
                if frame.is_request:
                    await send_refusal(conn, error_response(frame, exc))
                raise
            await _RECEIVED.get(type(event), TapStream._not_allowed)(self, event, frame)
        log.info("%s: client closed the TAP connection", self.name)
        scope.cancel()

    async def _on_noop(self, noop: TapNoop, _frame: Frame) -> None:
        await self.conn.send(encode(TapNoopResponse(noop.opaque)))

    async def _on_noop_response(self, _response: TapNoopResponse, _frame: Frame) -> None:
        pass  # the answer to our keep-alive: the socket is alive, nothing else to do

    async def _not_allowed(self, event: Any, frame: Frame) -> None:
        refused = ProtocolError(
            f"{event.NAME} is not allowed on a TAP producer connection",
            opcode=frame.opcode,
            status=Status.NOT_SUPPORTED,
        )
        await send_refusal(self.conn, error_response(frame, refused))
        raise refused

    async def _on_response(self, response: TapResponse, _frame: Frame) -> None:
        self.last_ack = trio.current_time()  # 2.x's processAck moves the expiry on
        released = self.settlements.answered(
            response.opaque, response.status, trio.current_time(), response.text, response.opcode
        )
        if response.status and self.producer.state is ProducerState.BACKING_OFF:
            log.info("%s: client busy (0x%02x): backing off", self.name, response.status)
        self._settled(released)
        self._wake.set()

    def _settled(self, settlements: list[Settlement[VbPosition]]) -> None:
        """A registered client's positions that acks (or sends, without support-ack)
        made final."""
        registration = self.registration
        if registration is not None:
            for settlement in settlements:
                registration.positions.update(settlement.positions)

    @property
    def last_acked(self) -> int:
        return self.settlements.last_acked

    # -- statistics ----------------------------------------------------------

    @property
    def items_remaining(self) -> int:
        store = self.store
        return sum(
            max(0, store.high_seqno(c.vb) - c.seqno)
            for c in self.plan.cursors
            if c.phase is not Phase.DONE
        )

    def connection_figures(self) -> dict[str, object]:
        return connection_figures(self)

    def takeover_stats(self, vbucket: int) -> dict[str, str] | None:
        cursor = self.cursors.get(vbucket)
        return None if cursor is None else takeover_stats(self, cursor)


class _Sending(NamedTuple):
    held: Callable[[TapStream], Awaitable[None]]
    """What the message waits to be acked first, with ``tap_wait_control_acks``."""
    stamped: Callable[[TapStream, int], None]
    """What its sequence number (or its sending) records."""


_SENDING: dict[type, _Sending] = {
    TapOpaque: _Sending(TapStream._held_by_nothing, TapStream._control_stamped),
    TapVbucketSet: _Sending(TapStream._held_by_nothing, TapStream._state_stamped),
    TapCheckpointStart: _Sending(TapStream._held_by_control, TapStream._checkpoint_stamped),
    TapCheckpointEnd: _Sending(TapStream._held_by_control, TapStream._checkpoint_stamped),
    TapMutation: _Sending(TapStream._held_by_control_and_checkpoint, TapStream._item_stamped),
    TapDelete: _Sending(TapStream._held_by_control_and_checkpoint, TapStream._item_stamped),
}
"""Each message the producer sends: what it waits for and what sending it records."""

_RECEIVED: dict[type, Callable[[TapStream, Any, Frame], Awaitable[None]]] = {
    TapResponse: TapStream._on_response,
    TapNoop: TapStream._on_noop,
    TapNoopResponse: TapStream._on_noop_response,
}
"""What the reader does with each TAP packet from the client (any other is refused
with NOT_SUPPORTED and closes the connection)."""
