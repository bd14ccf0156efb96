"""UPR producer connections of the reference node, as a 3.0 node runs them.

Theory of operation. ``serve_upr_producer`` takes over a connection after its
OPEN (released dialect; it answers the OPEN itself) or its first STREAM_REQ
or GET_FAILOVER_LOG (the draft, which has no OPEN). One ``ProducerConnection``
then runs three kinds of task in one nursery:

- the reader (this function's own task): decodes each request of the
  consumer and answers it at once: CONTROL, STREAM_REQ, GET_FAILOVER_LOG,
  CLOSE_STREAM, NOOP, and through the node's command door what is not UPR
  (STAT, VERSION, GET, ..., as memcached 3.0 does); it credits
  BUFFER_ACKNOWLEDGEMENTs to the flow-control window and hands the responses
  a producer waits for (NOOP, SET_VBUCKET_STATE, acknowledged
  SNAPSHOT_MARKERs) to whoever waits;
- one task per stream (``upr_streams.ProducerStream``), which reads the store
  in bounded batches and sends them;
- the NOOP task, when the consumer enabled NOOPs: one NOOP per interval, and
  the connection drops if the previous one is still unanswered.

The protocol decisions are the sans-IO ``ProducerMachine``'s, driven by
``UprProducerBase``. Every stream message goes through ``send_counted``: it
waits while the flow-control window (``ProducerWindow``) is full
(``_wait_for_room``, shared with the UPR front), then queues the message
with ``PacketConnection.send``, which itself waits while the socket's outbox
is full. So a stream stops at the consumer's announced buffer and, with no
flow control, at the outbox limit; memory stays bounded either way.

A malformed packet gets an error response naming what was wrong, then the
connection closes (``ProtocolError`` propagates to ``gateway.io.connection``).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from adapters import upr
from adapters.mcbp import Status
from adapters.upr.flow_control import counts
from adapters.upr.opening import Opening, notifies_only
from adapters.upr.rollback import resolve_end
from gateway.io.connection import PacketConnection
from gateway.io.upr_producer import UprProducerBase
from gateway.io.upr_stream import NotifierStream
from gateway.node.upr_hub import UprHub
from gateway.node.upr_streams import ProducerStream, StreamSettings, check_request

__all__ = ["ProducerConnection", "UprHub", "serve_upr_producer"]

log = logging.getLogger(__name__)

_OK = Status.SUCCESS.value
ITEMS = frozenset({upr.Mutation, upr.Deletion, upr.Expiration})


async def serve_upr_producer(node: Any, conn: PacketConnection, opening: Opening) -> None:
    """Run a producer connection until the consumer leaves or the name is reused."""
    producer = ProducerConnection(node, conn, opening.name, opening.flags)
    try:
        with node.upr.running(producer):
            if opening.reply:
                await conn.send(opening.reply)  # the OPEN's OK
            await producer.run(opening.first)
    finally:
        node.trimmer.connection_closed()


class ProducerConnection(UprProducerBase[ProducerStream | NotifierStream]):
    kind = "producer"

    def __init__(self, node: Any, conn: PacketConnection, name: str, flags: upr.OpenFlags) -> None:
        delete_times = bool(flags & upr.OpenFlags.INCLUDE_DELETE_TIMES)
        store = node.store
        super().__init__(
            conn,
            name,
            node.dialect,
            node.config.upr_noop_interval,
            delete_times=delete_times,
            serves=lambda vb: 0 <= vb < store.n_vbuckets,
            high_seqno=store.high_seqno,
            backfilling=node.upr.initial_backfill.__contains__,
            notifier=notifies_only(flags),
            answer=node.door.answer,
        )
        self.node = node
        self.settings = StreamSettings(
            delete_times=delete_times,
            draft=upr.Command.SNAPSHOT_MARKER not in self.dialect.opcodes,
        )
        self.items_sent = 0
        self.messages_sent = 0
        self.bytes_sent = 0

    # -- sending ---------------------------------------------------------------

    async def send_counted(self, event: upr.UprRequest) -> None:
        """Send a stream message, first waiting for room in the flow-control window."""
        data = upr.encode(event, self.dialect)
        counted = self.window.enabled and counts(event)
        if counted:
            await self._wait_for_room()
        await self.conn.send(data)
        if counted:
            self.window.sent(len(data))
        self.messages_sent += 1
        self.bytes_sent += len(data)
        if type(event) in ITEMS:
            self.items_sent += 1

    # -- requests ----------------------------------------------------------------

    async def _stream_request(self, req: upr.StreamRequest) -> None:
        store = self.node.store
        if 0 <= req.vbucket < store.n_vbuckets:
            req = resolve_end(req, store.high_seqno(req.vbucket))
        notifier = self.machine.notifier
        answer = check_request(store, req, self.settings.draft, notifier=notifier)
        if not isinstance(answer, upr.StreamRequestOk):
            await self.respond(answer)
            return
        stream: ProducerStream | NotifierStream
        if notifier:
            # The changes at the request: one before the task runs ends it too.
            beyond = partial(self._beyond, req.vbucket, store.state_changes(req.vbucket))
            stream = NotifierStream(req, send=self.send_counted, beyond=beyond)
        else:
            stream = ProducerStream(self, req)
        self.machine.add_stream(req.vbucket, stream)
        await self.respond(answer)
        assert self._nursery is not None
        self._nursery.start_soon(stream.run)

    async def _beyond(self, vb: int, seen: int, start: int) -> upr.StreamEndReason:
        """A notifier stream's wait: OK once the vbucket's high seqno passes
        ``start``, STATE_CHANGED once it changes state (3.0 ep.cc
        ``setVBucketState`` tells every stream of the vbucket, but not of a
        takeover stream's own hand-off: ``Store.set_state``)."""
        store, changes = self.node.store, self.node.changes
        while store.state_changes(vb) == seen:
            if store.high_seqno(vb) > start:
                return upr.StreamEndReason.OK
            await changes.wait(vb)  # nothing awaited since the look: none missed
        return upr.StreamEndReason.STATE_CHANGED

    async def _failover_log(self, req: upr.GetFailoverLog) -> None:
        store = self.node.store
        if not 0 <= req.vbucket < store.n_vbuckets:
            await self._refuse(req, Status.NOT_MY_VBUCKET, f"no vbucket {req.vbucket}")
            return
        await self.respond(upr.FailoverLogResponse(store.failover_log(req.vbucket), req.opaque))

    def _on_expiry_opcode(self, enabled: bool) -> None:
        self.settings.expiry_opcode = enabled

    # -- statistics ----------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self.bytes_sent

    @property
    def items_remaining(self) -> int:
        return sum(s.items_remaining() for s in self.streams.values())

    def _stat_counts(self) -> tuple[int, int, int]:
        return self.items_sent, self.items_remaining, self.bytes_sent

    def _stream_stats(self, prefix: str) -> list[tuple[str, str]]:
        return [pair for vb in sorted(self.streams) for pair in self.streams[vb].stats()]

    def takeover_stats(self, vbucket: int) -> dict[str, str] | None:
        stream = self.streams.get(vbucket)
        if not isinstance(stream, ProducerStream):
            return None  # 3.0 ``addTakeoverStats``: active streams only
        return stream.takeover_stats()
