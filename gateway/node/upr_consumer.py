"""UPR consumer connections: this node receives vbuckets (the end of a move).

Theory of operation. A connection OPENed with no flags makes this node the
consumer. ``ConsumerConnection`` only moves bytes: it decodes each frame,
hands the event to its ``ConsumerMachine`` (adapters/upr/consumer_machine.py,
which holds every decision: ADD_STREAM, the node's own STREAM_REQ, rollback,
markers and their acks, items, SET_VBUCKET_STATE, STREAM_END, CLOSE_STREAM,
NOOP), sends the replies and logs the notes that come back. ``StoreReplica``
is the machine's view of the store: a vbucket receives a stream unless it is
not here, ACTIVE or DEAD; an item the store refuses closes the connection.
A DISK marker into an empty vbucket makes STREAM_REQs for it TMPFAIL until
its end seqno is applied or the next marker (``UprHub.initial_backfill``).

Flow control: the node announces ``connection_buffer_size`` with CONTROL
before anything else and acknowledges processed bytes with
BUFFER_ACKNOWLEDGEMENT as ``ConsumerAcker`` decides (a fifth of the buffer,
or every few seconds).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, error_response
from adapters.upr.consumer_machine import ConsumerMachine, Item, PassiveStream
from adapters.upr.flow_control import ConsumerAcker, counts
from adapters.upr.opening import Opening
from adapters.upr.producer_machine import Reply
from gateway.io.connection import PacketConnection
from gateway.node.items import ItemKind, StoreError, VBucketState

log = logging.getLogger(__name__)

BUFFER_SIZE = 10 * 1024 * 1024
"""The flow-control buffer announced to producers (3.0's default)."""
ACK_TIMER_SECONDS = 1.0
_NOT_RECEIVING = (VBucketState.ACTIVE, VBucketState.DEAD)
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


async def serve_upr_consumer(node: Any, conn: PacketConnection, opening: Opening) -> None:
    """Run a consumer connection until its peer leaves or the name is reused."""
    consumer = ConsumerConnection(node, conn, opening.name)
    with node.upr.running(consumer):
        await conn.send(opening.reply)  # the OPEN's OK
        await consumer.run()


class ConsumerConnection:
    kind = "consumer"

    def __init__(self, node: Any, conn: PacketConnection, name: str) -> None:
        self.node = node
        self.store = node.store
        self.conn = conn
        self.name = name
        self.dialect: upr.Dialect = node.dialect
        self.acker = ConsumerAcker(BUFFER_SIZE, now=trio.current_time())
        replica = StoreReplica(node.store, self.dialect)
        self.machine = ConsumerMachine(self.dialect, replica, node.upr.initial_backfill)
        self.bytes_received = 0
        self.bytes_acked = 0

    # -- running -----------------------------------------------------------------

    async def run(self) -> None:
        size = str(self.acker.buffer_size).encode()
        await self.send(upr.Control(b"connection_buffer_size", size, opaque=self._next()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ack_timer)
            while (frame := await self.conn.receive_frame()) is not None:
                await self._receive(frame)
            nursery.cancel_scope.cancel()

    async def _receive(self, frame: Frame) -> None:
        try:
            event = upr.decode_frame(frame, self.dialect)
        except ProtocolError as exc:
            if frame.magic == Magic.REQUEST:
                await self.conn.send(error_response(frame, exc))
            raise
        self.bytes_received += frame.size
        await self.handle(event)
        if counts(event):
            await self._ack(self.acker.processed(frame.size, trio.current_time()))

    async def _ack_timer(self) -> None:
        while True:
            await trio.sleep(ACK_TIMER_SECONDS)
            await self._ack(self.acker.due(trio.current_time()))

    async def _ack(self, size: int) -> None:
        if size:
            self.bytes_acked += size
            await self.send(upr.BufferAcknowledgement(size, opaque=self._next()))

    async def send(self, event: upr.UprEvent) -> None:
        await self.conn.send(upr.encode(event, self.dialect))

    def _next(self) -> int:
        return self.machine.next_opaque()

    @property
    def streams(self) -> dict[int, PassiveStream]:
        return self.machine.streams

    @property
    def items_received(self) -> int:
        return self.machine.items_received

    async def handle(self, event: upr.UprEvent) -> None:
        for output in self.machine.receive(event, time.time()):
            if isinstance(output, Reply):
                await self.conn.send(output.data)
            else:
                log.log(_LEVELS[output.level], "%s: %s", self.name, output.text)

    # -- statistics ------------------------------------------------------------------

    @property
    def items_sent(self) -> int:
        return 0

    @property
    def total_bytes(self) -> int:
        return self.bytes_received

    @property
    def items_remaining(self) -> int:
        return 0

    def connection_stats(self) -> list[tuple[str, str]]:
        out = [
            ("type", "consumer"),
            ("items_received", str(self.items_received)),
            ("total_bytes_received", str(self.bytes_received)),
            ("total_acked_bytes", str(self.bytes_acked)),
            ("unacked_bytes", str(self.acker.freed)),
            ("max_buffer_bytes", str(self.acker.buffer_size)),
            ("num_streams", str(len(self.streams))),
        ]
        for vb in sorted(self.streams):
            out.extend(self.streams[vb].stats())
        return out

    def takeover_stats(self, vbucket: int) -> dict[str, str] | None:
        return None


class StoreReplica:
    """The node's store as a ``consumer_machine.Replica``."""

    def __init__(self, store: Any, dialect: upr.Dialect) -> None:
        self.store = store
        self.dialect = dialect
        self.high_seqno = store.high_seqno
        self.snapshot = store.snapshot
        self.set_snapshot = store.set_snapshot
        self.uuid = store.uuid
        self.replace_failover_log = store.replace_failover_log
        self.rollback = store.rollback

    def receives(self, vbucket: int) -> bool:
        store = self.store
        return 0 <= vbucket < store.n_vbuckets and store.state(vbucket) not in _NOT_RECEIVING

    def set_state(self, vbucket: int, state: int, now: float) -> None:
        self.store.set_state(vbucket, state, now=now)

    def apply(self, item: Item, now: float) -> None:
        try:
            self._apply(item, now)
        except StoreError as exc:
            raise ProtocolError(
                f"cannot apply {item.NAME} of vbucket {item.vbucket}: {exc}",
                opcode=self.dialect.opcodes[item.COMMAND],
                field="by_seqno",
                value=item.by_seqno,
            ) from None

    def _apply(self, item: Item, now: float) -> None:
        if isinstance(item, upr.Mutation):
            self.store.apply_mutation(
                item.vbucket,
                item.key,
                item.value,
                flags=item.flags,
                expiration=item.expiration,
                cas=item.cas,
                rev_seqno=item.rev_seqno,
                by_seqno=item.by_seqno,
                lock_time=item.lock_time,
                datatype=item.datatype,
                now=now,
            )
            return
        kind = ItemKind.EXPIRATION if isinstance(item, upr.Expiration) else ItemKind.DELETION
        self.store.apply_deletion(
            item.vbucket,
            item.key,
            cas=item.cas,
            rev_seqno=item.rev_seqno,
            by_seqno=item.by_seqno,
            kind=kind,
            delete_time=item.delete_time,
            now=now,
        )
