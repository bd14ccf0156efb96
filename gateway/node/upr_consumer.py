"""UPR consumer connections: this node receives vbuckets (the end of a move).

Theory of operation. A connection OPENed with no flags makes this node the
consumer. Whoever opened it (an orchestrator, or the gateway) sends
ADD_STREAM(vbucket, flags); the node answers with the opaque it will use for
that stream and then sends, on the same connection, its own STREAM_REQ built
from the vbucket's state: start = high seqno, the newest failover uuid, and
the last snapshot received (so a consumer stopped mid-snapshot resumes it).
The orchestrator relays that request to a producer, and the producer's
answer and stream back here:

- OK: the producer's failover log replaces ours and items follow;
- ROLLBACK(seqno): the store rolls back to it, and the request is sent again
  from the new position (a bounded number of times);
- a SNAPSHOT_MARKER records the snapshot being received (the resume point);
  with the ACK flag the node answers once the marker's end seqno is applied;
  a DISK one into an empty vbucket makes STREAM_REQs for it TMPFAIL until
  its end seqno is applied or the next marker (``UprHub.initial_backfill``);
- MUTATION/DELETION/EXPIRATION are applied with the producer's seqnos and
  metadata; SET_VBUCKET_STATE sets the vbucket's state and is answered;
  STREAM_END ends the stream.

Flow control: the node announces ``connection_buffer_size`` with CONTROL
before anything else and acknowledges processed bytes with
BUFFER_ACKNOWLEDGEMENT as ``ConsumerAcker`` decides (a fifth of the buffer,
or every few seconds). NOOPs are answered.

ADD_STREAM is refused with NOT_MY_VBUCKET for a vbucket that is not here or
is ACTIVE (writes of its own would clash with the producer's seqnos), and
with KEY_EXISTS while the vbucket already has a live stream.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import trio

from adapters import upr
from adapters.errors import ProtocolError
from adapters.mcbp import Frame, Magic, Status
from adapters.upr.flow_control import ConsumerAcker, counts
from adapters.upr.opening import Opening
from gateway.io.connection import PacketConnection
from gateway.io.replies import refusal
from gateway.node.items import ItemKind, StoreError, VBucketState

log = logging.getLogger(__name__)

BUFFER_SIZE = 10 * 1024 * 1024
"""The flow-control buffer announced to producers (3.0's default)."""
ACK_TIMER_SECONDS = 1.0
MAX_ROLLBACKS = 8
"""Rollbacks accepted for one ADD_STREAM before the stream is given up."""
MAX_SEQNO = 0xFFFFFFFFFFFFFFFF
_OK = Status.SUCCESS.value
_NOT_RECEIVING = (VBucketState.ACTIVE, VBucketState.DEAD)


async def serve_upr_consumer(node: Any, conn: PacketConnection, opening: Opening) -> None:
    """Run a consumer connection until its peer leaves or the name is reused."""
    consumer = ConsumerConnection(node, conn, opening.name)
    with node.upr.running(consumer):
        await conn.send(opening.reply)  # the OPEN's OK
        await consumer.run()


class PassiveStream:
    """One vbucket this node is receiving."""

    def __init__(self, vbucket: int, opaque: int, flags: upr.StreamFlags) -> None:
        self.vbucket = vbucket
        self.opaque = opaque
        self.flags = flags
        self.state = "pending"
        """pending (requested), reading (accepted), dead."""
        self.snapshot = (0, 0)
        self.ack_due = False
        """The current snapshot's marker asked for an ACK, not sent yet."""
        self.rollbacks = 0
        self.items_received = 0
        self.last_seqno = 0

    def stats(self) -> list[tuple[str, str]]:
        prefix = f"stream_{self.vbucket}_"
        values: list[tuple[str, object]] = [
            ("state", self.state),
            ("opaque", self.opaque),
            ("flags", f"0x{int(self.flags):x}"),
            ("items_received", self.items_received),
            ("last_received_seqno", self.last_seqno),
            ("snap_start_seqno", self.snapshot[0]),
            ("snap_end_seqno", self.snapshot[1]),
            ("rollbacks", self.rollbacks),
        ]
        return [(prefix + name, str(value)) for name, value in values]


class ConsumerConnection:
    kind = "consumer"

    def __init__(self, node: Any, conn: PacketConnection, name: str) -> None:
        self.node = node
        self.store = node.store
        self.conn = conn
        self.name = name
        self.dialect: upr.Dialect = node.dialect
        self.acker = ConsumerAcker(BUFFER_SIZE, now=trio.current_time())
        self.streams: dict[int, PassiveStream] = {}
        self._by_opaque: dict[int, PassiveStream] = {}
        self._opaques = itertools.count(1)
        self.items_received = 0
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
                await self.conn.send(refusal(frame.opcode, frame.opaque, exc))
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
        return next(self._opaques)

    async def handle(self, event: upr.UprEvent) -> None:
        if isinstance(event, upr.Mutation | upr.Deletion | upr.Expiration):
            await self._item(event)
        elif isinstance(event, upr.SnapshotMarker):
            await self._marker(event)
        elif isinstance(event, upr.StreamRequestOk | upr.StreamRequestRollback | upr.Response):
            await self._response(event)
        elif isinstance(event, upr.AddStream):
            await self._add_stream(event)
        elif isinstance(event, upr.SetVbucketState):
            await self._set_vbucket_state(event)
        elif isinstance(event, upr.StreamEnd):
            self._stream_end(event)
        elif isinstance(event, upr.CloseStream):
            await self._close_stream(event)
        elif isinstance(event, upr.Noop):
            await self.send(upr.Response(upr.Command.NOOP, event.opaque, _OK))
        elif event.IS_RESPONSE:
            log.debug("%s: ignoring response %r", self.name, event)
        elif not isinstance(event, upr.Flush):
            text = f"{event.NAME} is not for a consumer".encode()
            await self.send(upr.Response(event.COMMAND, event.opaque, Status.NOT_SUPPORTED, text))

    # -- stream set-up -------------------------------------------------------------

    async def _add_stream(self, req: upr.AddStream) -> None:
        vb = req.vbucket
        live = self.streams.get(vb)
        status: Status | None = None
        if not 0 <= vb < self.store.n_vbuckets or self.store.state(vb) in _NOT_RECEIVING:
            status = Status.NOT_MY_VBUCKET
        elif live is not None and live.state != "dead":
            status = Status.KEY_EXISTS
        if status is not None:
            await self.send(upr.AddStreamResponse(0, req.opaque, status.value))
            return
        stream = PassiveStream(vb, self._next(), req.flags)
        self.streams[vb] = stream
        self._by_opaque[stream.opaque] = stream
        await self.send(upr.AddStreamResponse(stream.opaque, req.opaque, _OK))
        await self.send(self._stream_request(stream))

    def _stream_request(self, stream: PassiveStream) -> upr.StreamRequest:
        vb = stream.vbucket
        high = self.store.high_seqno(vb)
        snap_start, snap_end = self.store.snapshot(vb)
        if not snap_start <= high <= snap_end:
            snap_start = snap_end = high  # no partial snapshot to resume
        return upr.StreamRequest(
            flags=stream.flags,
            start_seqno=high,
            end_seqno=MAX_SEQNO,
            vbucket_uuid=self.store.uuid(vb),
            snap_start_seqno=snap_start,
            snap_end_seqno=snap_end,
            opaque=stream.opaque,
            vbucket=vb,
        )

    async def _response(
        self, event: upr.StreamRequestOk | upr.StreamRequestRollback | upr.Response
    ) -> None:
        stream = self._by_opaque.get(event.opaque)
        if isinstance(event, upr.Response) and event.command is not upr.Command.STREAM_REQ:
            if event.status != _OK:
                log.warning(
                    "%s: %s refused: 0x%02x %r",
                    self.name,
                    event.command.name,
                    event.status,
                    event.value,
                )
            return
        if stream is None or stream.state != "pending":
            return
        if isinstance(event, upr.StreamRequestOk):
            self.store.replace_failover_log(stream.vbucket, event.failover_log)
            stream.state = "reading"
        elif isinstance(event, upr.StreamRequestRollback):
            await self._roll_back(stream, event.rollback_seqno)
        else:
            log.warning(
                "%s: stream request for vbucket %d refused: 0x%02x %r",
                self.name,
                stream.vbucket,
                event.status,
                event.value,
            )
            stream.state = "dead"

    async def _roll_back(self, stream: PassiveStream, seqno: int) -> None:
        stream.rollbacks += 1
        if stream.rollbacks > MAX_ROLLBACKS:
            log.warning("%s: vbucket %d keeps rolling back; giving up", self.name, stream.vbucket)
            stream.state = "dead"
            return
        vb = stream.vbucket
        high = self.store.rollback(vb, seqno)
        self.store.set_snapshot(vb, high, high)
        await self.send(self._stream_request(stream))

    # -- the stream ----------------------------------------------------------------

    def _reading(self, event: upr.UprRequest) -> PassiveStream | None:
        stream = self._by_opaque.get(event.opaque)
        if stream is None or stream.state != "reading" or stream.vbucket != event.vbucket:
            log.debug("%s: %s for no open stream (opaque %d)", self.name, event.NAME, event.opaque)
            return None
        return stream

    async def _marker(self, marker: upr.SnapshotMarker) -> None:
        stream = self._reading(marker)
        if stream is None:
            return
        await self._send_marker_ack(stream)  # a producer whose last marker overshot
        stream.snapshot = (marker.start_seqno, marker.end_seqno)
        stream.ack_due = bool(marker.flags & upr.SnapshotFlags.ACK)
        backfill = self.node.upr.initial_backfill
        if marker.flags & upr.SnapshotFlags.DISK and not self.store.high_seqno(stream.vbucket):
            backfill.add(stream.vbucket)  # stream requests for it: TMPFAIL until its end
        else:
            backfill.discard(stream.vbucket)
        self.store.set_snapshot(stream.vbucket, marker.start_seqno, marker.end_seqno)
        if stream.ack_due and self.store.high_seqno(stream.vbucket) >= marker.end_seqno:
            await self._send_marker_ack(stream)

    async def _send_marker_ack(self, stream: PassiveStream) -> None:
        if stream.ack_due:
            stream.ack_due = False
            await self.send(upr.Response(upr.Command.SNAPSHOT_MARKER, stream.opaque, _OK))

    async def _item(self, event: upr.Mutation | upr.Deletion | upr.Expiration) -> None:
        stream = self._reading(event)
        if stream is None:
            return
        try:
            self._apply(event)
        except StoreError as exc:
            raise ProtocolError(
                f"cannot apply {event.NAME} of vbucket {event.vbucket}: {exc}",
                opcode=self.dialect.opcodes[event.COMMAND],
                field="by_seqno",
                value=event.by_seqno,
            ) from None
        stream.items_received += 1
        stream.last_seqno = event.by_seqno
        self.items_received += 1
        if event.by_seqno >= stream.snapshot[1]:
            # 3.0.0 src/upr-stream.cc ``PassiveStream::handleSnapshotEnd``: the
            # snapshot's end applied ends the backfill phase (a checkpoint again).
            self.node.upr.initial_backfill.discard(stream.vbucket)
            await self._send_marker_ack(stream)

    def _apply(self, event: upr.Mutation | upr.Deletion | upr.Expiration) -> None:
        now = time.time()
        if isinstance(event, upr.Mutation):
            self.store.apply_mutation(
                event.vbucket,
                event.key,
                event.value,
                flags=event.flags,
                expiration=event.expiration,
                cas=event.cas,
                rev_seqno=event.rev_seqno,
                by_seqno=event.by_seqno,
                lock_time=event.lock_time,
                datatype=event.datatype,
                now=now,
            )
            return
        kind = ItemKind.EXPIRATION if isinstance(event, upr.Expiration) else ItemKind.DELETION
        self.store.apply_deletion(
            event.vbucket,
            event.key,
            cas=event.cas,
            rev_seqno=event.rev_seqno,
            by_seqno=event.by_seqno,
            kind=kind,
            delete_time=event.delete_time,
            now=now,
        )

    async def _set_vbucket_state(self, event: upr.SetVbucketState) -> None:
        stream = self._reading(event)
        if stream is not None:
            await self._send_marker_ack(stream)
            self.store.set_state(event.vbucket, event.state, now=time.time())
        status = _OK if stream is not None else Status.KEY_NOT_FOUND.value
        await self.send(upr.Response(upr.Command.SET_VBUCKET_STATE, event.opaque, status))

    def _stream_end(self, event: upr.StreamEnd) -> None:
        stream = self._by_opaque.get(event.opaque)
        if stream is not None and stream.vbucket == event.vbucket:
            stream.state = "dead"
            log.info(
                "%s: stream of vbucket %d ended: %s",
                self.name,
                event.vbucket,
                getattr(event.reason, "name", event.reason),
            )

    async def _close_stream(self, req: upr.CloseStream) -> None:
        stream = self.streams.get(req.vbucket)
        if stream is None or stream.state == "dead":
            status = Status.KEY_NOT_FOUND.value
        else:
            stream.state, status = "dead", _OK
        await self.send(upr.Response(upr.Command.CLOSE_STREAM, req.opaque, status))

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
